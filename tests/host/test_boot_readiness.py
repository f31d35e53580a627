"""Next-boot readiness on Ubuntu-like and Rocky-like host trees: two kernels, an NVIDIA module present
for one, real cpio initramfs archives with and without the nouveau blacklist, Secure Boot on and off."""

from __future__ import annotations

import gzip
import lzma
import os
import shutil
import subprocess
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from agent.host import boot_readiness
from agent.host.boot_readiness import (
    SECURE_BOOT_VAR,
    SIGNATURE_MAGIC,
    UnreadableArchive,
    boot_signature,
    check_initramfs,
    check_next_boot,
    host_tool_runner,
    initramfs_members,
    next_boot_kernel,
    running_driver_version,
    version_key,
)
from agent.host.paths import HostPaths

DRIVER = "580.159.04"
OLD, NEW = "6.8.0-49-generic", "6.8.0-50-generic"
EL_OLD, EL_NEW = "6.12.0-55.9.1.el10_0.x86_64", "6.12.0-55.12.1.el10_0.x86_64"
BLACKLIST_CONF = b"blacklist nouveau\noptions nouveau modeset=0\n"
T = TypeVar("T")


def newc(members: list[tuple[str, bytes]]) -> bytes:
    """A newc cpio archive, as `cpio -o -H newc` and the initramfs tools write it."""
    out = bytearray()
    for ino, (name, data) in enumerate([*members, ("TRAILER!!!", b"")], start=1):
        mode = 0o100644 if name != "TRAILER!!!" else 0
        encoded = name.encode() + b"\x00"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
        out += b"070701" + b"".join(f"{v:08x}".encode() for v in fields) + encoded
        out += b"\x00" * ((-len(out)) % 4) + data
        out += b"\x00" * ((-len(out)) % 4)
    return bytes(out)


def module_bytes(version: str, signed: bool) -> bytes:
    modinfo = f"license=Dual MIT/GPL\x00srcversion=ABCDEF0123\x00version={version}\x00vermagic=x SMP\x00".encode()
    body = b"\x7fELF" + os.urandom(64) + b"\x00" + modinfo + os.urandom(2 * 1024 * 1024)
    return body + (b"\x00sig..." + SIGNATURE_MAGIC if signed else b"")


def write(root: Path, host_path: str, data: bytes) -> Path:
    path = root / host_path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def initramfs(blacklist: bool, nouveau_module: bool = True, compress: str = "gzip", early: bool = True) -> bytes:
    members = [("usr/lib/modules/x/kernel/drivers/gpu/drm/nouveau/nouveau.ko.zst", b"m")] if nouveau_module else []
    members.append(("etc/hostname", b"node\n"))
    if blacklist:
        members.append(("etc/modprobe.d/gpu-agent-nouveau.conf", BLACKLIST_CONF))
    main = newc(members)
    packed = {"gzip": gzip.compress, "xz": lzma.compress, "none": lambda b: b}[compress](main)
    prefix = newc([("kernel/x86/microcode/GenuineIntel.bin", b"ucode")]) + b"\x00" * 512 if early else b""
    return prefix + packed


def ubuntu_tree(root: Path, *, module_for: str | None = NEW, blacklist: bool = True, secure_boot: bool = False) -> None:
    for kernel in (OLD, NEW):
        write(root, f"/boot/vmlinuz-{kernel}", b"kernel")
        write(root, f"/boot/initrd.img-{kernel}", initramfs(blacklist))
    os.symlink(f"vmlinuz-{NEW}", root / "boot/vmlinuz")
    if module_for is not None:
        write(root, f"/lib/modules/{module_for}/updates/dkms/nvidia.ko", module_bytes(DRIVER, signed=True))
    write(
        root,
        "/proc/driver/nvidia/version",
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {DRIVER}  Release Build\n".encode(),
    )
    write(root, "/proc/sys/kernel/osrelease", f"{OLD}\n".encode())
    write(root, SECURE_BOOT_VAR, b"\x06\x00\x00\x00" + (b"\x01" if secure_boot else b"\x00"))


def rocky_tree(root: Path, *, signed: bool = True, secure_boot: bool = True, saved: str | None = None) -> None:
    for kernel in (EL_OLD, EL_NEW):
        write(root, f"/boot/vmlinuz-{kernel}", b"kernel")
        write(root, f"/boot/initramfs-{kernel}.img", initramfs(blacklist=True, compress="xz"))
        write(
            root,
            f"/boot/loader/entries/0123abcd-{kernel}.conf",
            f"title Rocky Linux ({kernel})\nversion {kernel}\nlinux /vmlinuz-{kernel}\n".encode(),
        )
    write(root, f"/lib/modules/{EL_NEW}/extra/nvidia/nvidia.ko.xz", lzma.compress(module_bytes(DRIVER, signed)))
    write(root, f"/lib/modules/{EL_OLD}/extra/nvidia/nvidia.ko.xz", lzma.compress(module_bytes(DRIVER, True)))
    if saved is not None:
        write(root, "/boot/grub2/grubenv", f"# GRUB Environment Block\nsaved_entry=0123abcd-{saved}\n".encode())
    write(
        root, "/proc/driver/nvidia/version", f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {DRIVER}  Sat\n".encode()
    )
    write(root, SECURE_BOOT_VAR, b"\x06\x00\x00\x00" + (b"\x01" if secure_boot else b"\x00"))


def test_ubuntu_ready_when_the_next_kernel_has_a_module_and_a_blacklisted_initramfs(tmp_path: Path) -> None:
    ubuntu_tree(tmp_path)
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert verdict.kernel is not None and verdict.kernel.release == NEW
    assert verdict.kernel.told_by == "/boot/vmlinuz link"
    assert verdict.module is not None and verdict.module.version == DRIVER and verdict.module.signed
    assert verdict.initramfs is not None and verdict.initramfs.verdict == "blacklisted"
    assert verdict.initramfs.detail == "/etc/modprobe.d/gpu-agent-nouveau.conf"
    assert verdict.ready and verdict.problems == ()
    assert verdict.summary().startswith(f"{NEW} — ready")


def test_ubuntu_module_built_only_for_the_running_kernel_is_not_ready(tmp_path: Path) -> None:
    ubuntu_tree(tmp_path, module_for=OLD)  # DKMS failed for the new kernel
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert not verdict.ready
    assert verdict.summary() == f"{NEW} — nvidia {DRIVER} module missing"


def test_initramfs_without_blacklist_that_carries_nouveau_is_not_ready(tmp_path: Path) -> None:
    ubuntu_tree(tmp_path, blacklist=False)
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert verdict.initramfs is not None and verdict.initramfs.verdict == "nouveau included"
    assert verdict.problems == ("initramfs loads nouveau (rebuild the initramfs)",)


def test_initramfs_without_nouveau_at_all_is_fine(tmp_path: Path) -> None:
    write(tmp_path, f"/boot/initrd.img-{NEW}", initramfs(blacklist=False, nouveau_module=False, compress="none"))
    check = check_initramfs(HostPaths.at(tmp_path), NEW, None)
    assert check.verdict == "nouveau not included" and check.keeps_nouveau_out


def test_missing_initramfs_is_not_ready(tmp_path: Path) -> None:
    ubuntu_tree(tmp_path)
    (tmp_path / f"boot/initrd.img-{NEW}").unlink()
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert "no initramfs" in verdict.problems


def test_driver_version_mismatch_is_named(tmp_path: Path) -> None:
    ubuntu_tree(tmp_path)
    verdict = check_next_boot(HostPaths.at(tmp_path), driver_version="570.172.08")
    assert verdict.problems == (f"nvidia module is {DRIVER}, the running driver is 570.172.08",)


def test_rocky_saved_entry_picks_the_kernel_and_secure_boot_needs_a_signature(tmp_path: Path) -> None:
    rocky_tree(tmp_path, signed=False, secure_boot=True, saved=EL_NEW)
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert verdict.kernel is not None and (verdict.kernel.release, verdict.kernel.told_by) == (
        EL_NEW,
        "grubenv saved_entry",
    )
    assert verdict.secure_boot is True
    assert verdict.module is not None and verdict.module.path == f"/lib/modules/{EL_NEW}/extra/nvidia/nvidia.ko.xz"
    assert verdict.problems == ("nvidia module unsigned while Secure Boot is on",)


def test_rocky_unsigned_module_is_fine_without_secure_boot(tmp_path: Path) -> None:
    rocky_tree(tmp_path, signed=False, secure_boot=False)
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert verdict.kernel is not None and verdict.kernel.told_by == "newest BLS entry"
    assert verdict.kernel.release == EL_NEW
    assert verdict.ready, verdict.problems
    assert verdict.initramfs is not None and verdict.initramfs.verdict == "blacklisted"


def test_rocky_saved_entry_on_the_older_kernel(tmp_path: Path) -> None:
    rocky_tree(tmp_path, signed=False, secure_boot=True, saved=EL_OLD)
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert verdict.kernel is not None and verdict.kernel.release == EL_OLD
    assert verdict.ready  # the old kernel's module is signed


def test_no_efi_means_no_secure_boot(tmp_path: Path) -> None:
    ubuntu_tree(tmp_path)
    shutil.rmtree(tmp_path / "sys")
    assert check_next_boot(HostPaths.at(tmp_path)).secure_boot is False


def test_newest_kernel_without_link_or_bls(tmp_path: Path) -> None:
    for kernel in ("5.15.0-9-generic", "5.15.0-10-generic", "5.4.0-200-generic"):
        write(tmp_path, f"/boot/vmlinuz-{kernel}", b"k")
    found = next_boot_kernel(HostPaths.at(tmp_path), None)
    assert found is not None and found.release == "5.15.0-10-generic"


def test_version_key_orders_numerically() -> None:
    assert sorted(["6.8.0-100-generic", "6.8.0-9-generic", "6.10.0-1-generic"], key=version_key) == [
        "6.8.0-9-generic",
        "6.8.0-100-generic",
        "6.10.0-1-generic",
    ]


def test_proc_driver_version_both_module_flavours(tmp_path: Path) -> None:
    paths = HostPaths.at(tmp_path)
    write(tmp_path, "/proc/driver/nvidia/version", b"NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat\n")
    assert running_driver_version(paths) == "535.104.05"
    write(
        tmp_path,
        "/proc/driver/nvidia/version",
        b"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  R\n",
    )
    assert running_driver_version(paths) == "580.159.04"


@pytest.mark.skipif(shutil.which("cpio") is None, reason="cpio not installed")
def test_reads_an_archive_written_by_the_real_cpio(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "etc/modprobe.d").mkdir(parents=True)
    (tree / "etc/modprobe.d/nvidia-installer-disable-nouveau.conf").write_bytes(BLACKLIST_CONF)
    (tree / "lib").mkdir()
    names = "etc\netc/modprobe.d\netc/modprobe.d/nvidia-installer-disable-nouveau.conf\nlib\n"
    archive = subprocess.run(
        ["cpio", "-o", "-H", "newc", "--quiet"], input=names.encode(), cwd=tree, capture_output=True, check=True
    ).stdout
    target = write(tmp_path, f"/boot/initrd.img-{NEW}", gzip.compress(archive))
    names_seen = [name for name, _ in initramfs_members(target, lambda _n: False)]
    assert "etc/modprobe.d/nvidia-installer-disable-nouveau.conf" in names_seen
    assert check_initramfs(HostPaths.at(tmp_path), NEW, None).verdict == "blacklisted"


@pytest.mark.skipif(shutil.which("zstd") is None, reason="zstd not installed")
def test_zstd_initramfs_through_the_decompressor(tmp_path: Path) -> None:
    early = newc([("kernel/x86/microcode/AuthenticAMD.bin", b"u")])
    main = subprocess.run(
        ["zstd", "-q", "-c"], input=newc([("etc/modprobe.d/b.conf", BLACKLIST_CONF)]), capture_output=True, check=True
    ).stdout
    write(tmp_path, f"/boot/initrd.img-{NEW}", early + main)
    assert check_initramfs(HostPaths.at(tmp_path), NEW, None).verdict == "blacklisted"


def test_unreadable_archive_is_unverified_not_a_verdict(tmp_path: Path) -> None:
    write(tmp_path, f"/boot/initrd.img-{NEW}", b"\x02\x21\x4c\x18" + b"lz4 frames")  # legacy lz4
    check = check_initramfs(HostPaths.at(tmp_path), NEW, None)
    assert check.verdict == "unverified" and check.keeps_nouveau_out is None


def test_tools_never_run_against_a_tree(tmp_path: Path) -> None:
    assert host_tool_runner(HostPaths.at(tmp_path)) is None


def stand_in_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, script: str) -> None:
    """A program `name` first on PATH (a stand-in: nothing of the host runs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / name
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_a_host_tools_answer_is_its_stdout_whole_in_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against `/` (a stand-in tool: nothing of the host runs): stdout on exit 0 is the answer;
    stderr, a failure, an answer over the bound and a tool past its deadline are none."""
    monkeypatch.setenv("GPU_AGENT_TEST_SECRET", "hunter2")
    stand_in_tool(
        tmp_path, monkeypatch, "lister", 'echo "warning" >&2; echo "${GPU_AGENT_TEST_SECRET:-scrubbed}"; echo "$1"\n'
    )
    stand_in_tool(tmp_path, monkeypatch, "failing", "echo partial; exit 2\n")
    stand_in_tool(tmp_path, monkeypatch, "flooding", "head -c 5000 /dev/zero | tr '\\0' x\n")
    stand_in_tool(tmp_path, monkeypatch, "hanging", "echo early; sleep 60\n")
    monkeypatch.setattr(boot_readiness, "_TOOL_OUTPUT_LIMIT_BYTES", 4096)
    monkeypatch.setattr(boot_readiness, "_TOOL_TIMEOUT_SECONDS", 0.5)
    run = host_tool_runner(HostPaths.at("/"))
    assert run is not None
    assert run(["lister", "/boot/initrd.img"]) == "scrubbed\n/boot/initrd.img"
    assert run(["failing"]) is None
    assert run(["flooding"]) is None
    assert run(["hanging"]) is None
    assert run(["no-such-tool"]) is None


def test_a_stalled_zstd_leaves_the_initramfs_unverified_at_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in_tool(tmp_path / "tools", monkeypatch, "zstd", "sleep 60\n")
    monkeypatch.setattr(boot_readiness, "_TOOL_TIMEOUT_SECONDS", 0.5)
    write(tmp_path, f"/boot/initrd.img-{NEW}", b"\x28\xb5\x2f\xfd" + b"frames")
    check = check_initramfs(HostPaths.at(tmp_path), NEW, None)
    assert check.verdict == "unverified"
    assert check.detail == f"{tmp_path}/tools/bin/zstd did not finish in 0.5 s"


def test_signature_changes_when_a_kernel_is_installed(tmp_path: Path) -> None:
    ubuntu_tree(tmp_path)
    paths = HostPaths.at(tmp_path)
    before = boot_signature(paths)
    os.utime(tmp_path / "boot", (1, 1))
    assert boot_signature(paths) != before


def test_a_host_without_kernels_or_module_trees_does_not_manage_its_kernel(tmp_path: Path) -> None:
    """As on the H200 VM: an empty /boot, no /lib/modules, the driver loaded from the image."""
    (tmp_path / "boot").mkdir()
    write(
        tmp_path,
        "/proc/driver/nvidia/version",
        b"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  R\n",
    )
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert verdict.ready and not verdict.managed_here
    assert verdict.summary().startswith("no kernel in /boot and no /lib/modules")
    (tmp_path / "lib/modules").mkdir(parents=True)  # kernels are managed here, but none is installed
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert verdict.problems == ("no installed kernel found in /boot",) and verdict.managed_here


# -- containment: what is planted in /boot or the module tree ----------------------------------------


def finishes(seconds: float, work: Callable[[], T]) -> T:
    """`work()`'s answer, failing the test (not hanging it) when it takes longer than `seconds`."""
    answer: list[T] = []
    thread = threading.Thread(target=lambda: answer.append(work()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    assert answer, "raised"
    return answer[0]


def test_a_fifo_or_a_device_where_the_module_should_be_is_refused(tmp_path: Path) -> None:
    ubuntu_tree(tmp_path, module_for=None)
    modules = tmp_path / f"lib/modules/{NEW}/updates/dkms"
    modules.mkdir(parents=True)
    os.mkfifo(modules / "nvidia.ko")
    verdict = finishes(10, lambda: check_next_boot(HostPaths.at(tmp_path)))
    assert verdict.module is not None
    assert verdict.module.unreadable is not None and "a FIFO" in verdict.module.unreadable
    assert any("nvidia.ko: cannot be read: not a regular file (a FIFO)" in note for note in verdict.notes)
    (modules / "nvidia.ko").unlink()
    (modules / "nvidia.ko").symlink_to("/dev/zero")
    verdict = finishes(10, lambda: check_next_boot(HostPaths.at(tmp_path)))
    assert verdict.module is not None and verdict.module.unreadable is not None
    assert "a character device" in verdict.module.unreadable


def test_fifos_as_grubenv_bls_entry_and_initramfs_are_refused(tmp_path: Path) -> None:
    rocky_tree(tmp_path, saved=EL_OLD)
    (tmp_path / "boot/grub2/grubenv").unlink()
    os.mkfifo(tmp_path / "boot/grub2/grubenv")
    os.mkfifo(tmp_path / "boot/loader/entries/zz-planted.conf")
    (tmp_path / f"boot/initramfs-{EL_NEW}.img").unlink()
    os.mkfifo(tmp_path / f"boot/initramfs-{EL_NEW}.img")
    verdict = finishes(10, lambda: check_next_boot(HostPaths.at(tmp_path)))
    assert verdict.kernel is not None and verdict.kernel.release == EL_NEW  # grubenv unread: the newest entry
    assert verdict.initramfs is not None and verdict.initramfs.verdict == "missing"


def test_a_secure_boot_variable_that_never_ends_is_refused(tmp_path: Path) -> None:
    ubuntu_tree(tmp_path)
    (tmp_path / SECURE_BOOT_VAR.lstrip("/")).unlink()
    (tmp_path / SECURE_BOOT_VAR.lstrip("/")).symlink_to("/dev/zero")
    verdict = finishes(10, lambda: check_next_boot(HostPaths.at(tmp_path)))
    assert verdict.secure_boot is None


def cpio_header(name_size: int, size: int = 0) -> bytes:
    fields = [1, 0o100644, 0, 0, 1, 0, size, 0, 0, 0, 0, name_size, 0]
    return b"070701" + b"".join(f"{v:08x}".encode() for v in fields)


@pytest.mark.parametrize("compress", ["none", "gzip"])
def test_a_cpio_header_claiming_a_huge_name_costs_only_what_is_there(tmp_path: Path, compress: str) -> None:
    archive = cpio_header(2 << 30) + b"etc/hostname\x00" + b"x" * 4096
    packed = gzip.compress(archive) if compress == "gzip" else archive
    write(tmp_path, f"/boot/initrd.img-{NEW}", packed)
    tracemalloc.start()
    try:
        with pytest.raises(UnreadableArchive, match="claims a name of 2147483648 bytes"):
            list(initramfs_members(tmp_path / f"boot/initrd.img-{NEW}", lambda name: True))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024


def test_a_cpio_member_claiming_more_than_is_there_ends_the_read(tmp_path: Path) -> None:
    archive = cpio_header(len(b"etc/hostname\x00"), size=3 << 30) + b"etc/hostname\x00" + b"\x00" + b"y" * 4096
    write(tmp_path, f"/boot/initrd.img-{NEW}", archive)
    with pytest.raises(UnreadableArchive, match="ends inside a file"):
        list(initramfs_members(tmp_path / f"boot/initrd.img-{NEW}", lambda name: False))


def test_decompressed_bytes_are_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(boot_readiness, "_INITRAMFS_LIMIT_BYTES", 1 << 20)
    monkeypatch.setattr(boot_readiness, "_MODULE_LIMIT_BYTES", 1 << 20)
    ubuntu_tree(tmp_path, module_for=None)
    # Zeros compress to almost nothing: a small file that decompresses far past the cap.
    member = cpio_header(2, size=8 << 20) + b"a\x00" + b"\x00" * (8 << 20)
    write(tmp_path, f"/boot/initrd.img-{NEW}", gzip.compress(member))
    write(tmp_path, f"/lib/modules/{NEW}/updates/dkms/nvidia.ko.xz", lzma.compress(b"\x00" * (8 << 20)))
    verdict = check_next_boot(HostPaths.at(tmp_path))
    assert verdict.module is not None and verdict.module.unreadable == f"more than {1 << 20} bytes uncompressed"
    assert verdict.initramfs is not None and verdict.initramfs.verdict == "unverified"
    assert "uncompressed" in verdict.initramfs.detail
