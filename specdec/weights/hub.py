"""Models and drafters named by their Hugging Face Hub id ("org/name"), as vLLM and SGLang take them.

    path = hub_snapshot("Qwen/Qwen2.5-1.5B-Instruct")   # a local directory with its config, weights, tokenizer
    path = hub_snapshot("Qwen/Qwen2.5-1.5B-Instruct", revision="main")   # or pinned: a branch, tag or commit

The files are fetched once into the Hub's own cache (shared with transformers, vLLM and SGLang; HF_HOME or
HF_HUB_CACHE move it, HF_TOKEN reads gated and private repositories, HF_HUB_OFFLINE=1 uses the cache alone).
Only what the engine loads comes: configs, safetensors weights, tokenizer files, chat templates and a drafter's
token ranking, not a repository's other weight formats (.bin, .gguf, ONNX).
"""

from __future__ import annotations

import re
from pathlib import Path

# what a model or drafter directory needs: the rest of a repository is often other formats of the same weights
WANTED_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.npz"]
# the Hub's repository ids: an owner and a name, each of letters, digits, '-', '_' and '.'
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def looks_like_repo_id(text: str) -> bool:
    """Whether `text` has the form of a Hub repository id ("org/name") and is no local path."""
    return REPO_ID.fullmatch(text) is not None and not Path(text).expanduser().exists()


def check_revision(name: str, revision: str | None) -> None:
    """A revision names a version of a Hub repository: given with anything else, it is refused (ValueError)."""
    if revision is not None and not looks_like_repo_id(name):
        raise ValueError(f"a revision ({revision!r}) picks a version of a Hugging Face Hub repository, and {name!r} is "
                         f"no Hub id (org/name); leave the revision out for a demo model, a directory or a file")


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local directory of the Hub repository `repo_id` at `revision` (a branch, tag or commit; None: its main
    branch), fetched into the Hub's cache when not there yet. Raises FileNotFoundError saying why it could not be had
    (no such repository or revision, no access, no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=WANTED_FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError) as err:
        raise FileNotFoundError(_why_unavailable(repo_id, revision, err)) from err


def _why_unavailable(repo_id: str, revision: str | None, err: Exception) -> str:
    """What a failed fetch of `repo_id` means to the user, by the Hub client's error."""
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if isinstance(err, GatedRepoError):  # (a kind of RepositoryNotFoundError: first)
        return (f"{repo_id} on the Hugging Face Hub is gated: accept its terms on its page and set HF_TOKEN to a "
                f"token of that account")
    if isinstance(err, RepositoryNotFoundError):
        return (f"{repo_id} is no repository on the Hugging Face Hub that this machine may read (a private one needs "
                f"HF_TOKEN); a local model is a directory holding config.json, or a .gguf file")
    if isinstance(err, RevisionNotFoundError):
        return f"{repo_id} on the Hugging Face Hub has no revision {revision!r} (a branch, tag or commit)"
    if isinstance(err, LocalEntryNotFoundError):
        return (f"{repo_id} could not be fetched from the Hugging Face Hub (no connection, or HF_HUB_OFFLINE set) and "
                f"is not in its cache; download it where the Hub is reachable, or pass its local directory")
    return f"{repo_id} could not be fetched from the Hugging Face Hub: {err}"
