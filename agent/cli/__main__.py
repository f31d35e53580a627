"""`python -m agent.cli`: what the packages' /usr/bin/gpu-agent runs."""

import sys

from agent.cli import main

sys.exit(main())
