"""The prompt set the default model ships for `chatapp route default` is the one its recipe writes."""

from __future__ import annotations

from pathlib import Path

from chatapp.models.route_prompts import ROUTE_PROMPTS_FILE
from chatapp.models.smollm2 import PARTS_DIR
from chatapp.recipes.smollm2 import build, data
from chatapp.training.corpus import read_dialogues, write_dialogues


def test_the_shipped_set_is_the_recipes(tmp_path: Path) -> None:
    expected = data.route_dialogues(build.ROUTE_PROMPTS, 0, tools=True)
    assert read_dialogues(PARTS_DIR / ROUTE_PROMPTS_FILE) == expected
    recall_questions = {recall for _kind, _fact, recall, _answer in data._FACTS_TRAIN}
    recall = [turns for turns in expected if len(turns) == 3 and turns[-1] in recall_questions]
    assert len(recall) == build.ROUTE_PROMPTS // 4  # a quarter recall a fact two turns back
    chains = [turns for turns in expected if len(turns) > 1 and turns[-1] not in recall_questions]
    assert len(chains) == build.ROUTE_PROMPTS // 6  # a sixth chain tool questions
    write_dialogues(tmp_path / "again.jsonl", expected)
    assert (tmp_path / "again.jsonl").read_bytes() == (PARTS_DIR / ROUTE_PROMPTS_FILE).read_bytes()
