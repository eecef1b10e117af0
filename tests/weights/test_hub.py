"""Models and drafters named by a Hugging Face Hub id: read from the Hub's own cache (offline here, as on a
machine whose cache already holds them), or refused with a message saying why."""

from __future__ import annotations

import shutil

import pytest

from drafters import resolve_drafter_path
from specdec.weights.demo_models import resolve_model
from specdec.weights.hub import looks_like_repo_id
from tests.conftest import build_tiny_model_with_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PINNED = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hub cache in tmp_path; `put(repo_id, folder)` files a folder as the repository's snapshot."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def put(repo_id: str, folder, commit: str = COMMIT, ref: str = "main") -> None:
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        shutil.copytree(folder, repo / "snapshots" / commit)

    return put


def test_a_hub_id_names_a_model_in_the_hubs_cache(hub_cache, tmp_path):
    from specdec import LLM, SamplingParams

    build_tiny_model_with_tokenizer(tmp_path / "tiny")
    hub_cache("someone/tiny-chat", tmp_path / "tiny")
    path = resolve_model("someone/tiny-chat", tmp_path / "specdec-cache")
    assert path.name == COMMIT and (path / "config.json").is_file()
    params = SamplingParams(max_new_tokens=5)
    by_id = LLM("someone/tiny-chat", None, device="cpu", num_kv_pages=64, page_size=4).generate(["Hello"], params)
    by_dir = LLM(str(tmp_path / "tiny"), None, device="cpu", num_kv_pages=64, page_size=4).generate(["Hello"], params)
    assert by_id[0].token_ids == by_dir[0].token_ids


def test_a_drafter_hub_id_is_its_snapshot(hub_cache, tmp_path):
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    hub_cache("someone/tiny-dflash", tmp_path / "drafter")
    assert resolve_drafter_path("someone/tiny-dflash").name == COMMIT


def test_a_hub_id_neither_cached_nor_reachable_says_so(hub_cache, tmp_path):
    for resolve in (lambda name: resolve_model(name, tmp_path / "cache"), resolve_drafter_path):
        with pytest.raises(FileNotFoundError, match="could not be fetched from the Hugging Face Hub"):
            resolve("someone/not-downloaded")


def test_a_hub_repository_without_a_config_is_refused_by_name(hub_cache, tmp_path):
    (tmp_path / "gguf-only").mkdir()
    (tmp_path / "gguf-only" / "README.md").write_text("GGUF files")
    hub_cache("someone/model-GGUF", tmp_path / "gguf-only")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model("someone/model-GGUF", tmp_path / "cache")


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    assert looks_like_repo_id("Qwen/Qwen2.5-1.5B-Instruct") and looks_like_repo_id("z-lab/Qwen3-8B-DFlash-b16")
    for other in ("/abs/model", "models/a/b", "plain-name", "org/", "./org/name", "org/na me"):
        assert not looks_like_repo_id(other), other
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not looks_like_repo_id("org/name")  # an existing local path stays a path


def test_a_revision_picks_a_version_of_a_hub_repository(hub_cache, tmp_path, capsys):
    """vLLM's --revision: a tag or a commit of a Hub id; given with anything else, refused before any loading."""
    from specdec import LLM, generate

    for name in ("new", "old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    hub_cache("someone/tiny-dflash", tmp_path / "new")
    hub_cache("someone/tiny-dflash", tmp_path / "old", commit=PINNED, ref="v1")
    assert resolve_drafter_path("someone/tiny-dflash").name == COMMIT
    assert resolve_drafter_path("someone/tiny-dflash", "v1").name == PINNED
    assert resolve_drafter_path("someone/tiny-dflash", PINNED).name == PINNED
    with pytest.raises(FileNotFoundError, match="could not be fetched|no revision"):
        resolve_drafter_path("someone/tiny-dflash", "v2")
    build_tiny_model_with_tokenizer(tmp_path / "tiny")
    with pytest.raises(ValueError, match="no Hub id"):
        resolve_model(tmp_path / "tiny", tmp_path / "cache", revision="v1")
    with pytest.raises(ValueError, match="drafter given by Hugging Face Hub id"):
        LLM(str(tmp_path / "tiny"), None, device="cpu", drafter_revision="v1")
    with pytest.raises(ValueError, match="no Hub id"):
        LLM(str(tmp_path / "tiny"), str(tmp_path / "new"), device="cpu", drafter_revision="v1")
    assert generate.main(["--target", str(tmp_path / "tiny"), "--revision", "v1", "--no-drafter", "--prompt", "x",
                          "--device", "cpu"]) == 2
    assert "no Hub id" in capsys.readouterr().err


def test_each_way_a_fetch_fails_is_told_apart():
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    from specdec.weights.hub import _why_unavailable

    def error(kind):  # the Hub client's error, made without the HTTP response its constructor wants
        return kind.__new__(kind)

    assert "gated" in _why_unavailable("a/b", None, error(GatedRepoError))
    assert "no repository" in _why_unavailable("a/b", None, error(RepositoryNotFoundError))
    assert "no revision 'v9'" in _why_unavailable("a/b", "v9", error(RevisionNotFoundError))
