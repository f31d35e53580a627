"""The embedded default: a simulated node, a stand-in inference server, fault injection."""
