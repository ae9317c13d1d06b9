"""Publishing a converted folder to the Hugging Face Hub in one commit.

Order of work, so that a failure never leaves anything half-published:
1. refuse bad input (repo id, token, offline mode, folder layout) before any work;
2. evaluate (optional) and write the results into the card (restored as it was if any later step fails);
3. the pre-push check (:func:`hf_symmetry.hub.check.prepush_check`): the folder must load and
   run where hf_symmetry is not installed;
4. ``create_repo`` and a single ``create_commit`` holding every file (weights, config,
   remote code, tokenizer, card, plots). If the commit fails on a repo this push created,
   the empty repo is deleted again.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, constants, get_token
from huggingface_hub.utils import HFValidationError
from huggingface_hub.utils import validate_repo_id as hf_validate

from .. import __version__
from .cards import CARD_RECORD, README, update_card
from .check import prepush_check
from .entries import lm_eval_results, text_perplexity_result

# Never published: pickles (hf_symmetry writes safetensors only), local clutter, and the local
# conversion record (it may hold local paths; the card's metadata carries its public part).
REFUSED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
SKIPPED_NAMES = ("__pycache__", CARD_RECORD)


@dataclass
class PushResult:
    repo_id: str
    commit_url: str
    commit_oid: str
    files: list[str]
    bytes: int
    created_repo: bool
    check: dict | None = None
    eval_results: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_token(token: str | None = None) -> str:
    """The token given, else ``HF_TOKEN`` / the one saved by ``hf auth login``."""
    token = token or get_token()
    if not token:
        raise ValueError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (pushing needs write access)")
    return token


def validate_repo_id(repo_id: str) -> str:
    if not repo_id or repo_id.count("/") != 1:
        raise ValueError(f"repo id must be 'user/name' or 'org/name', got {repo_id!r}")
    try:
        hf_validate(repo_id)
    except HFValidationError as exc:
        raise ValueError(f"invalid repo id {repo_id!r}: {str(exc).splitlines()[0]}") from None
    return repo_id


def check_online() -> None:
    if constants.is_offline_mode():
        raise ValueError("HF_HUB_OFFLINE is set: pushing needs the network (unset HF_HUB_OFFLINE)")


def publishable_files(folder: Path) -> list[Path]:
    """Every file of the folder except hidden ones and caches, in a stable order."""
    files = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if not p.is_file() or any(part.startswith(".") or part in SKIPPED_NAMES for part in rel.parts):
            continue
        files.append(p)
    return files


def check_folder(folder: str | os.PathLike) -> Path:
    """Refuse folders that are not a complete safetensors HF model folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"folder {folder} does not exist")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    pickles = [p.name for p in publishable_files(folder) if p.suffix in REFUSED_SUFFIXES]
    if pickles:
        raise ValueError(
            f"{folder} holds pickled files ({', '.join(pickles[:3])}); hf_symmetry publishes safetensors only"
        )
    if not list(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    config = json.loads(cfg_path.read_text())
    for auto_class, ref in (config.get("auto_map") or {}).items():
        for r in ref if isinstance(ref, list) else [ref]:
            if r and "--" not in r:  # "repo--module.Class" points elsewhere on the Hub
                module = r.rsplit(".", 1)[0]
                if not (folder / f"{module}.py").is_file():
                    raise FileNotFoundError(f"{folder}: auto_map {auto_class} needs {module}.py, which is missing")
    return folder


def _eval_for_card(folder: Path, evaluation: CardEvaluation, progress: bool) -> list[dict]:
    results = []
    if evaluation.text:
        results.append(text_perplexity_result(folder, evaluation.text, progress=progress))
    if evaluation.tasks:
        results += lm_eval_results(folder, evaluation.tasks, task_dir=evaluation.task_dir, limit=evaluation.limit)
    return results


@dataclass(frozen=True)
class CardEvaluation:
    """What is measured for the model card before a push: perplexity on ``text``, and the lm-eval ``tasks``
    (from ``task_dir``, at most ``limit`` examples each)."""

    text: str | None = None
    tasks: list[str] | None = None
    task_dir: str | None = None
    limit: int | None = None


@dataclass(frozen=True)
class HubCommit:
    """How the push reaches the Hub: the ``token`` (None: the stored login), the ``endpoint`` (None:
    ``HF_ENDPOINT``, else huggingface.co) and the commit ``message`` (None: the folder's name and kind)."""

    token: str | None = None
    endpoint: str | None = None
    message: str | None = None


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    evaluation: CardEvaluation = CardEvaluation(),
    check: bool = True,
    check_text: str | None = None,
    commit: HubCommit = HubCommit(),
    progress: bool = True,
) -> PushResult:
    """Publish ``folder`` as ``repo_id`` in one commit (see the module docstring). A push that fails leaves the
    folder as it was (its card is restored)."""
    validate_repo_id(repo_id)
    token = resolve_token(commit.token)
    check_online()
    folder = check_folder(folder)
    card_before = {name: _read_or_none(folder / name) for name in (README, CARD_RECORD)}
    try:  # the card names the repo and the new results only once they are published: a failure restores it
        return _publish(folder, repo_id, private, (evaluation, check, check_text), commit, token, progress)
    except BaseException:
        for name, data in card_before.items():
            _restore(folder / name, data)
        raise


def _publish(folder: Path, repo_id: str, private: bool, checks: tuple, commit: HubCommit, token: str, progress: bool):
    """:func:`push_folder`'s work after its refusals: the card, the check (``checks``: the evaluation, whether to
    check and on which text), the repo and the one commit."""
    start = time.perf_counter()
    evaluation, check, check_text = checks
    results = _eval_for_card(folder, evaluation, progress)
    update_card(folder, eval_results=results, repo_id=repo_id)
    check_report = prepush_check_for(folder, check_text) if check else None

    files = publishable_files(folder)
    # HF_ENDPOINT read now, not at huggingface_hub's import, so tests and scripts can point it anywhere.
    api = HfApi(endpoint=commit.endpoint or os.environ.get("HF_ENDPOINT") or None, token=token)
    try:
        existed = api.repo_exists(repo_id)
        api.create_repo(repo_id, private=private, exist_ok=True)
    except Exception as exc:
        raise ValueError(f"could not create {repo_id} on {api.endpoint}: {_one_line(exc)}") from exc
    operations = [
        CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p)) for p in files
    ]
    try:
        info = api.create_commit(repo_id, operations, commit_message=commit.message or _default_message(folder))
    except Exception as exc:
        if not existed:
            _delete_quietly(api, repo_id)
        raise ValueError(f"the Hub refused the commit to {repo_id} (nothing was published): {_one_line(exc)}") from exc
    return PushResult(
        repo_id=repo_id,
        commit_url=str(info.commit_url),
        commit_oid=info.oid,
        files=[p.relative_to(folder).as_posix() for p in files],
        bytes=sum(p.stat().st_size for p in files),
        created_repo=not existed,
        check=check_report.as_dict() if check_report else None,
        eval_results=results,
        seconds=time.perf_counter() - start,
    )


def prepush_check_for(folder: Path, text: str | None = None):
    """The pre-push check, on the text the card's exactness figures were measured on."""
    if text is None:
        record = folder / CARD_RECORD
        if record.is_file():
            text = (json.loads(record.read_text())["data"].get("exactness") or {}).get("text")
        if text and not Path(text).is_file():
            text = None
    return prepush_check(folder, text=text)


def _default_message(folder: Path) -> str:
    kind = ""
    record = folder / CARD_RECORD
    if record.is_file():
        kind = f" ({json.loads(record.read_text())['kind']})"
    return f"Upload {folder.name}{kind} with hf_symmetry {__version__}"


def _read_or_none(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _restore(path: Path, data: bytes | None) -> None:
    """Put back a card file as it was before a failed push (``None``: it did not exist)."""
    if data is None:
        path.unlink(missing_ok=True)
    elif _read_or_none(path) != data:
        path.write_bytes(data)


def _delete_quietly(api, repo_id: str) -> None:
    try:
        api.delete_repo(repo_id, missing_ok=True)
    except Exception:  # the commit error is what the user needs to see
        pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
