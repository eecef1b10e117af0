"""Models and drafters named by their Hugging Face Hub id ("org/name"), as vLLM and SGLang take them.

    path = hub_snapshot("Qwen/Qwen2.5-1.5B-Instruct")   # a local directory with its config, weights, tokenizer

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


def hub_snapshot(repo_id: str) -> Path:
    """The local directory of the Hub repository `repo_id` (fetched into the Hub's cache when not there yet).
    Raises FileNotFoundError saying why it could not be had (no such repository, no access, no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    try:
        return Path(snapshot_download(repo_id, allow_patterns=WANTED_FILES))
    except GatedRepoError as err:
        raise FileNotFoundError(f"{repo_id} on the Hugging Face Hub is gated: accept its terms on its page and set "
                                f"HF_TOKEN to a token of that account") from err
    except RepositoryNotFoundError as err:
        raise FileNotFoundError(f"{repo_id} is no repository on the Hugging Face Hub that this machine may read (a "
                                f"private one needs HF_TOKEN); a local model is a directory holding config.json, or "
                                f"a .gguf file") from err
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(f"{repo_id} could not be fetched from the Hugging Face Hub (no connection, or "
                                f"HF_HUB_OFFLINE set) and is not in its cache; download it where the Hub is reachable, "
                                f"or pass its local directory") from err
    except HfHubHTTPError as err:
        raise FileNotFoundError(f"{repo_id} could not be fetched from the Hugging Face Hub: {err}") from err
