"""A Hugging Face Hub cache in a test's directory, offline: Hub ids without a network.

huggingface_hub reads ``HF_HUB_CACHE`` / ``HF_HOME`` and ``HF_HUB_OFFLINE`` once, when it is imported,
into ``huggingface_hub.constants``, and its functions read those constants when called
(``snapshot_download``: ``constants.HF_HUB_CACHE``; every request: ``constants.is_offline_mode()``).
So a test sets both: the constants, for this process (huggingface_hub may have been imported before),
and the environment, for a process it starts."""

from __future__ import annotations

import hashlib
import pathlib

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def offline_hub(monkeypatch: pytest.MonkeyPatch, cache: pathlib.Path) -> pathlib.Path:
    """Makes ``cache`` (created) the Hub cache, offline, for this process and those it starts."""
    from huggingface_hub import constants

    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache: pathlib.Path, repo_id: str, source: pathlib.Path, *, commit: str = COMMIT,
               refs: tuple[str, ...] = ("main",)) -> pathlib.Path:
    """Stores ``source``'s files as huggingface_hub caches model ``repo_id`` at ``commit``:
    ``models--ORG--NAME/blobs/<sha256>``, ``snapshots/<commit>/<file>`` linking to its blob and
    ``refs/<ref>`` holding the commit, for each of ``refs``. Returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(pathlib.Path("..", "..", "blobs", blob.name))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
