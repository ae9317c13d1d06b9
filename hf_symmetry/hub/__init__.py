"""Publishing: model cards for every conversion (``write_card``, the one entry point conversions
call), pushing folders to the Hub in one commit (``push_folder``), and the pre-push load check
in a Python where hf_symmetry cannot be imported (``prepush_check``)."""

from .cards import CARD_RECORD, card_eval_results, template_dir, update_card, write_card
from .check import LoadCheck, prepush_check
from .push import CardEvaluation, HubCommit, PushResult, push_folder

__all__ = [
    "CARD_RECORD",
    "CardEvaluation",
    "HubCommit",
    "LoadCheck",
    "PushResult",
    "card_eval_results",
    "prepush_check",
    "push_folder",
    "template_dir",
    "update_card",
    "write_card",
]
