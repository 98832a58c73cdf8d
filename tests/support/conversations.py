"""A small conversation dataset for training tests: two rounds each, where the second question is the same in every
conversation ("Another one?"), so only the first round tells the model what the second answer is."""

from __future__ import annotations

from pathlib import Path

from support.files import write_jsonl

SYSTEM = "Answer with one word."
FOLLOW_UP = "Another one?"
# (first question, first answer, second answer)
TOPICS = [("Name a colour.", "Red.", "Blue."), ("Name a fruit.", "Apple.", "Pear."),
          ("Name a planet.", "Mars.", "Venus."), ("Name a metal.", "Iron.", "Gold."),
          ("Name an animal.", "Dog.", "Cat."), ("Name a drink.", "Tea.", "Milk."),
          ("Name a month.", "May.", "June."), ("Name a day.", "Monday.", "Friday.")]


def two_rounds(question: str, first: str, second: str | None = None) -> list[dict]:
    """The conversation up to the follow-up question, and its second answer when given."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
                {"role": "assistant", "content": first}, {"role": "user", "content": FOLLOW_UP}]
    return messages + ([{"role": "assistant", "content": second}] if second is not None else [])


def second_answers(shift: int = 0) -> list[str]:
    """Each topic's second answer, or with `shift` the answer of the topic `shift` places on (knowledge a model
    trained on the unshifted data must unlearn)."""
    return [TOPICS[(i + shift) % len(TOPICS)][2] for i in range(len(TOPICS))]


def write_conversations(folder: Path, shift: int = 0) -> Path:
    """folder/chat_clean.jsonl with one conversation per topic; returns the folder (a dataset_path)."""
    rows = [{"messages": two_rounds(question, first, second), "source": "topics"}
            for (question, first, _), second in zip(TOPICS, second_answers(shift))]
    write_jsonl(folder / "chat_clean.jsonl", rows)
    return folder
