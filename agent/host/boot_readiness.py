"""Next-boot readiness: will the GPUs come back after a reboot?

The node that does not come back is the failure operators fear most: a kernel update whose NVIDIA
module was never built (DKMS failed), a module left unsigned while Secure Boot enforces signatures,
an initramfs that still loads nouveau. This module answers, for the kernel that boots next:

- which kernel that is (Debian/Ubuntu: the `/boot/vmlinuz` link; EL: the BLS entry named by
  grubenv's `saved_entry`, else the newest entry, as grub's blscfg sorts them; `grubby` when the
  host root is `/`);
- whether an NVIDIA module of the running driver's version exists for it (`updates/`, `extra/`,
  `weak-updates/`, `kernel/` under `/lib/modules/KERNEL`), and whether it is signed when Secure
  Boot is on (the kernel's "~Module signature appended~" trailer: a signature by a key the
  firmware does not trust is not detectable from files; the note says so);
- whether that kernel's initramfs keeps nouveau out: a modprobe.d file inside it blacklists
  nouveau, or nouveau's module is not in it at all. The archive is read here (concatenated newc
  cpio, uncompressed, gzip, xz; zstd through the `zstd` decompressor when installed); when it
  cannot be read and the host root is `/`, `lsinitramfs`/`lsinitrd` list it instead.

Everything is read under `host_root`; host tools (`grubby`, `mokutil`, `lsinitramfs`, `lsinitrd`)
run only when `host_root` is `/`. Every tool, the zstd decompressor included, runs through
agent.host.processes: a scrubbed environment, a 60 s deadline, bounded output. Nothing here writes.

Whoever can write /boot or a module tree can put anything there, and a disk can hang: every file
is opened as a regular file only (agent.host.file_reads: a FIFO or `nvidia.ko` -> `/dev/zero` is
refused before a byte is read), small files are read up to a bound, and archives are read by what
they actually hold, never by what a header claims (a cpio name is at most PATH_MAX bytes; the
bytes decompressed from a module or an initramfs are capped). The whole check runs on a worker of
its own with a deadline (agent.policy.next_boot), so a hung read costs that worker, not the policy.
"""

from __future__ import annotations

import contextlib
import gzip
import lzma
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO, Protocol, cast

from agent.host import file_reads
from agent.host.paths import HostPaths
from agent.host.processes import ProcessStream, run_process

SECURE_BOOT_VAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
SIGNATURE_MAGIC = b"~Module signature appended~\n"
MODULE_NAMES = ("nvidia.ko", "nvidia.ko.xz", "nvidia.ko.gz", "nvidia.ko.zst")
# depmod's default search order: an override in updates/ wins over the distro's kernel/ tree.
MODULE_SUBDIRS = ("updates", "extra", "weak-updates", "kernel")
_CHUNK_BYTES = 1 << 20
# grubenv is one 1 KiB block; a BLS entry, /proc and efivars answers are a few lines.
_SMALL_FILE_LIMIT_BYTES = 64 * 1024
# cpio names are paths: the kernel refuses longer than PATH_MAX when it unpacks the archive.
_CPIO_NAME_LIMIT_BYTES = 4096
# An uncompressed nvidia.ko is ~100 MB, an initramfs a few hundred MB: far past these is a bomb.
_MODULE_LIMIT_BYTES = 1 << 30
_INITRAMFS_LIMIT_BYTES = 4 << 30
_TOOL_TIMEOUT_SECONDS = 60.0
# lsinitramfs lists a few thousand paths, a few hundred KB: the bound of a host file read (file_reads).
_TOOL_OUTPUT_LIMIT_BYTES = 4 << 20
_CPIO_MAGICS = (b"070701", b"070702")
_GZIP_MAGIC = b"\x1f\x8b"
_XZ_MAGIC = b"\xfd7zXZ\x00"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MODPROBE_PREFIXES = ("etc/modprobe.d/", "usr/lib/modprobe.d/", "lib/modprobe.d/", "run/modprobe.d/")
_MODULE_VERSION = re.compile(rb"(?:^|\x00)version=([0-9][0-9.]*)\x00")
_PROC_VERSION = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)")

NOT_MANAGED = "no kernel in /boot and no /lib/modules: the kernel is not managed on this host (VM or container)"

#: Runs a host tool (argv) and returns its stdout, or None when it is absent or fails.
ToolRunner = Callable[[list[str]], str | None]


class _Stream(Protocol):
    def read(self, size: int, /) -> bytes: ...

    def close(self) -> None: ...


class UnreadableArchive(Exception):
    """The initramfs is in a form this host cannot read (lz4, or zstd without a decompressor)."""


@dataclass(frozen=True)
class NextKernel:
    release: str
    told_by: str  # how it was found: "/boot/vmlinuz link", "grubenv saved_entry", ...


@dataclass(frozen=True)
class ModuleFound:
    path: str  # host path, e.g. /lib/modules/6.8.0-50-generic/updates/dkms/nvidia.ko.zst
    version: str | None  # None: could not be read (compressed and no decompressor, or `unreadable`)
    signed: bool | None
    unreadable: str | None = None  # why the file could not be read


@dataclass(frozen=True)
class InitramfsCheck:
    path: str | None
    verdict: str  # "blacklisted" | "nouveau not included" | "nouveau included" | "missing" | "unverified"
    detail: str = ""

    @property
    def keeps_nouveau_out(self) -> bool | None:
        if self.verdict in ("blacklisted", "nouveau not included"):
            return True
        if self.verdict in ("nouveau included", "missing"):
            return False
        return None


@dataclass(frozen=True)
class BootReadiness:
    kernel: NextKernel | None
    running_kernel: str | None
    driver_version: str | None
    module: ModuleFound | None
    secure_boot: bool | None
    initramfs: InitramfsCheck | None
    problems: tuple[str, ...]  # each makes the next boot not ready
    notes: tuple[str, ...] = field(default=())  # what could not be verified

    @property
    def ready(self) -> bool:
        return not self.problems

    @property
    def managed_here(self) -> bool:
        """False where this host does not install its own kernels (a VM or container)."""
        return NOT_MANAGED not in self.notes

    def summary(self) -> str:
        """One line for `status`: `6.8.0-50-generic — nvidia 580.159.04 module missing`."""
        if not self.managed_here:
            return NOT_MANAGED
        kernel = self.kernel.release if self.kernel else "unknown kernel"
        if self.problems:
            return f"{kernel} — " + "; ".join(self.problems)
        told = f"nvidia {self.module.version}" if self.module and self.module.version else "nvidia module"
        return f"{kernel} — ready ({told}, initramfs {self.initramfs.verdict if self.initramfs else 'unchecked'})"


# -- versions -------------------------------------------------------------------------------------


def version_key(release: str) -> tuple[tuple[int, int | str], ...]:
    """Sort kernel releases as grub and rpm do: numeric runs by value, the rest as text."""
    parts = re.findall(r"\d+|[A-Za-z]+", release)
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def running_driver_version(paths: HostPaths) -> str | None:
    """The loaded NVIDIA kernel module's version from /proc/driver/nvidia/version."""
    try:
        text = paths.read_text("/proc/driver/nvidia/version", _SMALL_FILE_LIMIT_BYTES)
    except OSError:
        return None
    match = _PROC_VERSION.search(text)
    return match.group(1) if match else None


def running_kernel(paths: HostPaths) -> str | None:
    try:
        return paths.read_text("/proc/sys/kernel/osrelease", _SMALL_FILE_LIMIT_BYTES).strip() or None
    except OSError:
        return None


# -- which kernel boots next --------------------------------------------------------------------


def _installed_kernels(paths: HostPaths) -> list[str]:
    boot = paths.path("/boot")
    try:
        names = os.listdir(boot)
    except OSError:
        return []
    return sorted((n[len("vmlinuz-") :] for n in names if n.startswith("vmlinuz-")), key=version_key)


def _read_grubenv(paths: HostPaths, *candidates: str) -> dict[str, str]:
    for candidate in candidates:
        try:
            text = paths.read_text(candidate, _SMALL_FILE_LIMIT_BYTES)
        except (OSError, UnicodeDecodeError):
            continue
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    return {}


def _bls_entries(paths: HostPaths) -> dict[str, str]:
    """BLS entry id -> kernel release (`version` line, else the `linux` image name)."""
    directory = paths.path("/boot/loader/entries")
    entries: dict[str, str] = {}
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return entries
    for name in names:
        if not name.endswith(".conf"):
            continue
        try:
            text = file_reads.read_text(directory / name, _SMALL_FILE_LIMIT_BYTES)
        except (OSError, UnicodeDecodeError):
            continue
        fields = dict(
            line.strip().split(None, 1) for line in text.splitlines() if len(line.strip().split(None, 1)) == 2
        )
        release = fields.get("version") or Path(fields.get("linux", "")).name.removeprefix("vmlinuz-")
        if release:
            entries[name[: -len(".conf")]] = release
    return entries


def next_boot_kernel(paths: HostPaths, run: ToolRunner | None) -> NextKernel | None:
    if run is not None:
        default = run(["grubby", "--default-kernel"])
        if default and Path(default.strip()).name.startswith("vmlinuz-"):
            return NextKernel(Path(default.strip()).name.removeprefix("vmlinuz-"), "grubby --default-kernel")
    bls = _bls_entries(paths)
    if bls:
        saved = _read_grubenv(paths, "/boot/grub2/grubenv", "/boot/efi/EFI/grubenv").get("saved_entry", "")
        if saved in bls:
            return NextKernel(bls[saved], "grubenv saved_entry")
        return NextKernel(max(bls.values(), key=version_key), "newest BLS entry")
    link = paths.path("/boot/vmlinuz")
    if link.is_symlink():
        target = os.readlink(link)
        name = Path(target).name
        if name.startswith("vmlinuz-"):
            return NextKernel(name.removeprefix("vmlinuz-"), "/boot/vmlinuz link")
    kernels = _installed_kernels(paths)
    return NextKernel(kernels[-1], "newest /boot/vmlinuz-*") if kernels else None


# -- the NVIDIA module for that kernel ---------------------------------------------------------------


def _open_module(path: Path) -> _Stream | None:
    """The module's uncompressed bytes as a stream; None when it cannot be decompressed here.
    NotRegularFile when the path (or what its link names) is not a regular file."""
    name = path.name
    raw = file_reads.open_regular(path)
    decompressed: _Stream | None
    try:
        if name.endswith(".xz"):
            decompressed = lzma.LZMAFile(raw)  # noqa: SIM115 - closed by _Layered
        elif name.endswith(".gz"):
            decompressed = gzip.GzipFile(fileobj=raw, mode="rb")
        elif name.endswith(".zst"):
            decompressed = _zstd_stream(raw.fileno())
        else:
            return raw
    except BaseException:
        raw.close()
        raise
    if decompressed is None:
        raw.close()
        return None
    return _Layered(decompressed, raw)


def _scan_module(stream: _Stream) -> tuple[str | None, bool]:
    """(version from .modinfo, signed?) reading in chunks: a module is ~100 MB uncompressed."""
    version: str | None = None
    tail = b""
    total = 0
    with contextlib.closing(stream):
        while chunk := stream.read(_CHUNK_BYTES):
            total += len(chunk)
            if total > _MODULE_LIMIT_BYTES:
                raise UnreadableArchive(f"more than {_MODULE_LIMIT_BYTES} bytes uncompressed")
            window = tail + chunk
            if version is None and (match := _MODULE_VERSION.search(window)):
                version = match.group(1).decode("ascii", "replace")
            tail = window[-256:]
    return version, tail.endswith(SIGNATURE_MAGIC)


def find_nvidia_module(paths: HostPaths, kernel: str) -> ModuleFound | None:
    for base in (f"/lib/modules/{kernel}", f"/usr/lib/modules/{kernel}"):
        root = paths.path(base)
        for subdir in MODULE_SUBDIRS:
            for found in sorted(_walk_for(root / subdir, MODULE_NAMES)):
                host_path = "/" + str(found.relative_to(paths.root)).lstrip("/")
                try:
                    stream = _open_module(found)
                    if stream is None:
                        return ModuleFound(host_path, None, None)
                    version, signed = _scan_module(stream)
                except (OSError, lzma.LZMAError, EOFError, UnreadableArchive) as exc:
                    return ModuleFound(host_path, None, None, unreadable=_reason(exc))
                return ModuleFound(host_path, version, signed)
    return None


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _walk_for(root: Path, names: tuple[str, ...]) -> Iterator[Path]:
    if not root.is_dir():
        return
    for directory, _dirs, files in os.walk(root, followlinks=False):
        for name in files:
            if name in names:
                yield Path(directory) / name


# -- Secure Boot -------------------------------------------------------------------------------------


def secure_boot_enabled(paths: HostPaths, run: ToolRunner | None) -> bool | None:
    """True/False from the SecureBoot EFI variable (4 attribute bytes, then the value); a host
    without EFI boots without Secure Boot. None when it cannot be told."""
    try:
        data = paths.read_bytes(SECURE_BOOT_VAR, _SMALL_FILE_LIMIT_BYTES)
    except FileNotFoundError:
        if not paths.exists("/sys/firmware/efi"):
            return False
        data = b""
    except OSError:
        data = b""
    if len(data) >= 5:
        return data[4] == 1
    if run is not None and (answer := run(["mokutil", "--sb-state"])):
        return "enabled" in answer.lower()
    return None


# -- the initramfs -----------------------------------------------------------------------------------


def initramfs_path(paths: HostPaths, kernel: str) -> str | None:
    for candidate in (f"/boot/initrd.img-{kernel}", f"/boot/initramfs-{kernel}.img"):
        if paths.path(candidate).is_file():
            return candidate
    return None


def _zstd_stream(stdin_fd: int) -> _Stream | None:
    """zstd has no decoder in the standard library: the `zstd` program decompresses what it reads
    from `stdin_fd` (it only reads), within the host tools' deadline: past it, its read raises
    ProcessTimedOut (an OSError: the archive is unreadable). Closing the stream stops and reaps it.
    None when no zstd is installed."""
    tool = shutil.which("zstd")
    if tool is None:
        return None
    return ProcessStream([tool, "-dcq"], timeout_seconds=_TOOL_TIMEOUT_SECONDS, stdin_fd=stdin_fd, separate_errors=True)


class _Layered:
    """A decompressor over a file it does not own: closing it closes both."""

    def __init__(self, outer: _Stream, inner: _Stream) -> None:
        self._outer = outer
        self._inner = inner

    def read(self, size: int = -1) -> bytes:
        return self._outer.read(size)

    def close(self) -> None:
        try:
            self._outer.close()
        finally:
            self._inner.close()


class _Peekable:
    """A forward-only stream with a small look-ahead (decompressor streams cannot seek)."""

    def __init__(self, stream: _Stream, limit_bytes: int | None = None) -> None:
        self._stream = stream
        self._buffer = b""
        self._taken = 0
        self._limit_bytes = limit_bytes

    def consumed_from(self, raw: BinaryIO) -> int:
        """The offset in `raw` up to which this stream has been consumed."""
        return raw.tell() - len(self._buffer)

    def peek(self, size: int) -> bytes:
        while len(self._buffer) < size:
            # Never more than a chunk at a time: the size may be a header's claim, not what is there.
            chunk = self._stream.read(min(max(size - len(self._buffer), 4096), _CHUNK_BYTES))
            if not chunk:
                break
            self._taken += len(chunk)
            if self._limit_bytes is not None and self._taken > self._limit_bytes:
                raise UnreadableArchive(f"more than {self._limit_bytes} bytes uncompressed")
            self._buffer += chunk
        return self._buffer[:size]

    def read(self, size: int) -> bytes:
        data = self.peek(size)
        self._buffer = self._buffer[len(data) :]
        return data

    def skip(self, size: int) -> None:
        while size > 0:
            taken = len(self.read(min(size, _CHUNK_BYTES)))
            if not taken:
                raise UnreadableArchive("archive ends inside a file")
            size -= taken

    def skip_zeros(self) -> None:
        while (head := self.peek(512)) and not head.strip(b"\x00"):
            self.read(len(head))
        if head:
            self.read(len(head) - len(head.lstrip(b"\x00")))


def _cpio_members(stream: _Peekable, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes | None]]:
    """(name, content if wanted else None) for each member of one newc archive."""
    while True:
        header = stream.read(110)
        if len(header) < 110 or header[:6] not in _CPIO_MAGICS:
            raise UnreadableArchive("not a newc cpio header")
        mode = int(header[14:22], 16)
        size = int(header[54:62], 16)
        name_size = int(header[94:102], 16)
        if name_size > _CPIO_NAME_LIMIT_BYTES:
            raise UnreadableArchive(f"a cpio header claims a name of {name_size} bytes")
        name = stream.read(name_size).rstrip(b"\x00").decode("utf-8", "replace")
        stream.skip((-(110 + name_size)) % 4)
        if name == "TRAILER!!!":
            return
        is_file = mode & 0o170000 == 0o100000
        if is_file and wanted(name) and size <= _CHUNK_BYTES:
            yield name, stream.read(size)
        else:
            stream.skip(size)
            yield name, None
        stream.skip((-size) % 4)


def initramfs_members(path: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes | None]]:
    """Every member of an initramfs: concatenated archives (early microcode uncompressed, then the
    main one, usually compressed to the end of the file)."""
    # unbuffered: a zstd child reads on from our offset
    with file_reads.open_regular(path) as raw:
        stream = _Peekable(raw)
        while True:
            stream.skip_zeros()
            magic = stream.peek(6)
            if not magic:
                return
            if magic in _CPIO_MAGICS:
                yield from _cpio_members(stream, wanted)
                continue
            decompressed: _Stream | None
            if magic.startswith(_GZIP_MAGIC):
                # both only ever call read(): the look-ahead stream is enough of a file for them
                decompressed = gzip.GzipFile(fileobj=cast(IO[bytes], stream), mode="rb")
            elif magic.startswith(_XZ_MAGIC):
                decompressed = lzma.LZMAFile(cast(IO[bytes], stream))  # noqa: SIM115 - closed below
            elif magic.startswith(_ZSTD_MAGIC):
                raw.seek(stream.consumed_from(raw))
                decompressed = _zstd_stream(raw.fileno())
            else:
                raise UnreadableArchive(f"unknown archive format (magic {magic[:4].hex()})")
            if decompressed is None:
                raise UnreadableArchive("zstd-compressed and no zstd decompressor installed")
            with contextlib.closing(decompressed):
                inner = _Peekable(decompressed, _INITRAMFS_LIMIT_BYTES)
                while inner.peek(6):
                    yield from _cpio_members(inner, wanted)
                    inner.skip_zeros()
            return


def _blacklists_nouveau(text: str) -> bool:
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words[:2] == ["blacklist", "nouveau"] or (words[:2] == ["install", "nouveau"] and len(words) > 2):
            return True
    return False


def _is_modprobe_conf(name: str) -> bool:
    name = name.lstrip("./")
    return name.startswith(_MODPROBE_PREFIXES) and name.endswith(".conf")


def _is_nouveau_module(name: str) -> bool:
    return Path(name).name.startswith("nouveau.ko")


def check_initramfs(paths: HostPaths, kernel: str, run: ToolRunner | None) -> InitramfsCheck:
    host_path = initramfs_path(paths, kernel)
    if host_path is None:
        return InitramfsCheck(None, "missing", f"no initramfs for {kernel} in /boot")
    blacklisted_in: str | None = None
    nouveau_module: str | None = None
    try:
        for name, content in initramfs_members(paths.path(host_path), _is_modprobe_conf):
            if content is not None and _blacklists_nouveau(content.decode("utf-8", "replace")):
                blacklisted_in = blacklisted_in or name
            if _is_nouveau_module(name):
                nouveau_module = nouveau_module or name
    except (UnreadableArchive, OSError, EOFError, lzma.LZMAError, ValueError) as exc:
        return _check_initramfs_with_tool(host_path, run, str(exc))
    return _initramfs_verdict(host_path, blacklisted_in, nouveau_module)


def _initramfs_verdict(host_path: str, blacklisted_in: str | None, nouveau_module: str | None) -> InitramfsCheck:
    if blacklisted_in is not None:
        return InitramfsCheck(host_path, "blacklisted", f"/{blacklisted_in.lstrip('./')}")
    if nouveau_module is None:
        return InitramfsCheck(host_path, "nouveau not included")
    return InitramfsCheck(host_path, "nouveau included", f"/{nouveau_module.lstrip('./')} and no blacklist")


def _check_initramfs_with_tool(host_path: str, run: ToolRunner | None, why: str) -> InitramfsCheck:
    """Names only (lsinitramfs/lsinitrd): our own blacklist file is recognised by name."""
    listing = None
    if run is not None:
        listing = run(["lsinitramfs", host_path]) or run(["lsinitrd", host_path])
    if listing is None:
        return InitramfsCheck(host_path, "unverified", why)
    names = [line.split()[-1] for line in listing.splitlines() if line.strip()]
    confs = [n for n in names if _is_modprobe_conf(n) and "nouveau" in Path(n).name]
    module = next((n for n in names if _is_nouveau_module(n)), None)
    return _initramfs_verdict(host_path, confs[0] if confs else None, module)


# -- the verdict -------------------------------------------------------------------------------------


def host_tool_runner(paths: HostPaths) -> ToolRunner | None:
    """Host tools read the real host: they run only when host_root is `/`. A tool's answer is its
    stdout when it exits 0 within the deadline; an answer longer than _TOOL_OUTPUT_LIMIT_BYTES is
    no answer (a listing cut short would miss what it was asked for)."""
    if paths.root.resolve() != Path("/"):
        return None

    def run(argv: list[str]) -> str | None:
        program = shutil.which(argv[0])
        if program is None:
            return None
        try:
            done = run_process(
                [program, *argv[1:]],
                _TOOL_TIMEOUT_SECONDS,
                output_limit_bytes=_TOOL_OUTPUT_LIMIT_BYTES,
                separate_errors=True,
            )
        except OSError:
            return None
        return done.output if done.returncode == 0 and not done.output_cut_bytes else None

    return run


def check_next_boot(
    paths: HostPaths, driver_version: str | None = None, run: ToolRunner | None = None
) -> BootReadiness:
    """The whole verdict for the kernel that boots next. `driver_version`: the running driver's
    (NVML's answer); read from /proc/driver/nvidia/version when not given."""
    driver = driver_version or running_driver_version(paths)
    kernel = next_boot_kernel(paths, run)
    current = running_kernel(paths)
    problems: list[str] = []
    notes: list[str] = []
    if kernel is None:
        if not any(paths.exists(tree) for tree in ("/lib/modules", "/usr/lib/modules")):
            # A VM or container whose kernel comes from outside (seen on a single-GPU H200 VM: empty
            # /boot, no module tree, the driver built into the image): nothing here decides the next boot.
            return BootReadiness(None, current, driver, None, None, None, (), (NOT_MANAGED,))
        return BootReadiness(None, current, driver, None, None, None, ("no installed kernel found in /boot",))
    module = find_nvidia_module(paths, kernel.release)
    secure_boot = secure_boot_enabled(paths, run)
    if module is None:
        problems.append(f"nvidia {driver} module missing" if driver else "nvidia module missing")
    elif module.unreadable is not None:
        notes.append(f"{module.path}: cannot be read: {module.unreadable}")
    elif module.version is None:
        notes.append(f"{module.path}: version and signature not readable here")
    else:
        if driver is not None and module.version != driver:
            problems.append(f"nvidia module is {module.version}, the running driver is {driver}")
        if secure_boot and not module.signed:
            problems.append("nvidia module unsigned while Secure Boot is on")
        elif secure_boot:
            notes.append("module signed; whether the firmware trusts the key (MOK) is not checked")
    if secure_boot is None:
        notes.append("Secure Boot state unknown")
    initramfs = check_initramfs(paths, kernel.release, run)
    if initramfs.keeps_nouveau_out is False:
        problems.append(
            "no initramfs" if initramfs.verdict == "missing" else "initramfs loads nouveau (rebuild the initramfs)"
        )
    elif initramfs.keeps_nouveau_out is None:
        notes.append(f"initramfs not verified: {initramfs.detail}")
    return BootReadiness(kernel, current, driver, module, secure_boot, initramfs, tuple(problems), tuple(notes))


def boot_signature(paths: HostPaths) -> tuple[float, ...]:
    """Changes when a kernel, module tree or initramfs is installed or removed: the daemon re-checks
    then (and at least hourly) instead of reading a 100 MB module every loop."""
    stamps: list[float] = []
    for directory in ("/boot", "/boot/loader/entries", "/lib/modules", "/usr/lib/modules"):
        try:
            stamps.append(paths.path(directory).stat().st_mtime)
        except OSError:
            stamps.append(0.0)
    return tuple(stamps)
