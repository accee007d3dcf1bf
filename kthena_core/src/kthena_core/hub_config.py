"""A Hugging Face Hub repo's config.json, for planning a model named by its repo id.

``kthena plan --model ORG/NAME`` sizes a Hub model from its config.json alone (no weights), as
``kthena serve --model ORG/NAME`` would load it: huggingface_hub's cache (``HF_HUB_CACHE``, or
``HF_HOME/hub``) first, else the Hub, into that cache; with ``HF_HUB_OFFLINE=1`` the cache only.
huggingface_hub is not a dependency of kthena_core (kthena_serve brings it): without it a repo
id is refused with the command that installs it.
"""

from __future__ import annotations

from kthena_core.model_spec import ModelSpecError

__all__ = ["hub_config"]


def hub_config(repo_id: str) -> str:
    """The path of ``repo_id``'s config.json (``main``), cached or downloaded.

    Raises:
        ModelSpecError: huggingface_hub is not installed; the repo is not cached while the Hub
            is offline or unreachable; the Hub has no such repo this machine may read; or the
            repo has no config.json.
    """
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ModelSpecError(f"{repo_id}: planning a Hub repo reads its config.json with "
                             "huggingface_hub, which is not installed (`pip install "
                             "huggingface_hub`; kthena_serve brings it); or pass the path of "
                             "its config.json") from None
    try:
        return hf_hub_download(repo_id, "config.json", local_files_only=True)
    except (LocalEntryNotFoundError, OSError):
        pass  # not cached: download, unless offline
    if constants.HF_HUB_OFFLINE:
        raise ModelSpecError(_not_cached(repo_id, "HF_HUB_OFFLINE is set, so the Hub is not "
                                         "asked", constants.HF_HUB_CACHE))
    try:
        return hf_hub_download(repo_id, "config.json")
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as error:
        raise ModelSpecError(f"{repo_id}: the Hub has no repo of that name that this machine may "
                             f"read ({type(error).__name__}); check the name, or log in with "
                             "`hf auth login` for a gated or private repo") from None
    except LocalEntryNotFoundError as error:  # before EntryNotFoundError, which it may subclass
        raise ModelSpecError(_not_cached(repo_id, _reason(error), constants.HF_HUB_CACHE)) from None
    except EntryNotFoundError:
        raise ModelSpecError(f"{repo_id}: the repo has no config.json, so it is no Hugging Face "
                             "transformers checkpoint the planner can size") from None
    except (HfHubHTTPError, OSError) as error:
        raise ModelSpecError(_not_cached(repo_id, _reason(error), constants.HF_HUB_CACHE)) from None


def _reason(error: Exception) -> str:
    text = str(error).strip()
    return (f"the Hub could not be reached ("
            f"{text.splitlines()[0].removeprefix('Got: ') if text else type(error).__name__})")


def _not_cached(repo_id: str, why: str, cache: str) -> str:
    return (f"{repo_id}: its config.json is not in the Hugging Face cache {cache} and {why}; "
            f"download it on a machine with access (`hf download {repo_id} config.json` into "
            "the same HF_HUB_CACHE / HF_HOME), or pass the path of its config.json")
