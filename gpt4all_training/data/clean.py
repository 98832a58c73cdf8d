"""Normalise raw records into `prompt`/`response`/`source` records, `messages`/`source` conversations and
`prompt`/`chosen`/`rejected`/`source` preference pairs, and count every record dropped with its reason.

The files are JSON Lines, JSON arrays, Parquet or CSV (data/raw_files.py). Single-turn shapes are recognised by their
fields: gpt4all (`prompt`, `response`, `source`), Dolly (`instruction`, `context`, `response`, `category`), Alpaca
(`instruction`, `input`, `output`) and TRL's prompt/completion as text. Conversations (data/conversations.py): OpenAI
`messages`, ShareGPT `conversations`, TRL's prompt/completion as messages, and OpenAssistant message trees (one tree
per line) as whole threads (`--oasst paths`, the default, or `best`), or as every prompter->assistant pair with the
thread flattened into the prompt (`--oasst pairs`); a conversation keeps the tool definitions it offers (`tools`,
a list or a JSON string of one) and its turns' tool calls (arguments a JSON object: `invalid_tool_arguments` when
not) and reasoning (`reasoning_content`). Preference pairs (data/preferences.py): any record with
`chosen`/`rejected` answers (TRL, UltraFeedback-binarized, HH-RLHF), and OpenAssistant trees as the best-ranked reply
against each lower-ranked sibling (`--oasst-preferences`). With `--prompts`, every record is read as a prompt to
sample from (objective grpo, data/prompt_records.py): its prompt as text or messages, every other field kept for
the rewards. Each input unit (a line, an array element, a row) becomes kept records or dropped ones; nothing
vanishes: `kept + dropped == read` for every file.

Records stream through: each file is read unit by unit and written as it goes. What stays in memory is a 16-byte
digest per kept record for the exact duplicates (`first_time`), and, with `--near-duplicates`, its MinHash signature
and index buckets (data/near_duplicates.py): memory grows by bytes per record, not by the records' text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

from gpt4all_training.data.conversations import (OASST_THREAD_MODES, encodable, normalize_whitespace, oasst_threads,
                                                 openai_messages, prompt_completion_messages, record_tools,
                                                 sharegpt_messages, trained)
from gpt4all_training.data.near_duplicates import NearDuplicates
from gpt4all_training.data.preferences import (PAIR_FIELDS, answer_text, is_preference, normalized,
                                               oasst_preferences, preference_record)
from gpt4all_training.data.prompt_records import prompt_record
from gpt4all_training.data.raw_files import SUFFIXES, Unit, read_units
from gpt4all_training.errors import UserError
from gpt4all_training.files import atomic_file, atomic_write

AI_DISCLAIMER = re.compile(r"\bas an ai\b|\bai language model\b|\bi am an ai\b|\bi'm an ai\b", re.IGNORECASE)
REFUSAL = re.compile(
    r"^\s*(i'?m sorry|i am sorry|sorry,|i apologi[sz]e|unfortunately,? i|i can(no|')t (help|assist|provide|do))",
    re.IGNORECASE,
)
OASST_MODES = (*OASST_THREAD_MODES, "pairs")
OASST_PREFERENCES = "preferences"  # how clean reads trees under --oasst-preferences
REPORT_FILE = "clean_report.json"


@dataclass
class Filters:
    """Optional filters, all off by default."""

    drop_ai_disclaimers: bool = False
    drop_refusals: bool = False
    min_response_chars: int = 0


@dataclass
class FileReport:
    """`read` counts records: one per line, except that an OpenAssistant tree gives one per thread (or pair)."""

    lines: int = 0
    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {"lines": self.lines, "read": self.read, "kept": self.kept,
                "dropped": dict(sorted(self.dropped.items())), "dropped_total": sum(self.dropped.values())}


class Drop(Exception):
    """A record that cannot be kept; `reason` is the report key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _text(value: Any, name: str) -> str:
    # gpt4all's generations sometimes hold {"value": ...} or {"description": ...} instead of a string.
    if isinstance(value, dict):
        for key in ("value", "description"):
            if key in value:
                value = value[key]
                break
    if value is None:
        raise Drop(f"missing_{name}")
    if not isinstance(value, str):
        raise Drop(f"non_string_{name}")
    return value


def _gpt4all_record(obj: dict, default_source: str) -> dict[str, str]:
    for name in ("prompt", "response"):
        if name not in obj:
            raise Drop(f"missing_{name}")
    source = obj.get("source", default_source)
    return {"source": source if isinstance(source, str) else default_source,
            "prompt": _text(obj["prompt"], "prompt"), "response": _text(obj["response"], "response")}


def _instruction_record(obj: dict, context_key: str, response_key: str, source: str) -> dict[str, str]:
    """Dolly's (`context`, `response`) or Alpaca's (`input`, `output`) instruction record as prompt/response."""
    instruction = _text(obj.get("instruction"), "instruction")
    context = _text(obj.get(context_key) or "", context_key)  # "" for no context; null means the same
    response = _text(obj.get(response_key), response_key)
    # Context first, instruction last: truncation keeps the end of a prompt, and the question is what matters.
    prompt = f"{context}\n\n{instruction}" if context.strip() else instruction
    return {"source": source, "prompt": prompt, "response": response}


def _completion_record(obj: dict, source: str) -> dict[str, Any] | Drop:
    """TRL's prompt/completion: two strings as prompt/response, or messages as one conversation."""
    if "label" in obj:  # KTO's unpaired preference: a completion marked undesirable must not be learned
        return Drop("unpaired_preference")
    prompt, completion = obj.get("prompt"), obj.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return {"source": source, "prompt": prompt, "response": completion}
    return _conversation_record(prompt_completion_messages(obj), source, record_tools(obj))


def _oasst_records(tree: dict) -> Iterator[dict[str, str] | Drop]:
    """Every prompter->assistant pair, depth first; the thread above the pair becomes the prompt's context.

    A pair under a deleted message (or itself deleted) is dropped as `deleted_message`: its thread is incomplete.
    A malformed message is dropped once, with everything below it.
    """
    root = tree.get("prompt")
    if not isinstance(root, dict):
        yield Drop("missing_prompt")
        return
    stack: list[tuple[dict, list[tuple[str, str]], bool]] = [(root, [], False)]
    while stack:
        message, thread, deleted = stack.pop()
        role, text, replies = message.get("role"), message.get("text"), message.get("replies") or []
        if not isinstance(text, str) or role not in ("prompter", "assistant") or not isinstance(replies, list):
            yield Drop("malformed_message")
            continue
        deleted = deleted or bool(message.get("deleted"))
        if role == "assistant" and thread and thread[-1][0] == "prompter":
            if deleted:
                yield Drop("deleted_message")
            else:
                context = "\n".join(f"{'User' if r == 'prompter' else 'Assistant'}: {t}" for r, t in thread[:-1])
                prompt = f"{context}\n\n{thread[-1][1]}" if context else thread[-1][1]
                yield {"source": "oasst", "prompt": prompt, "response": text}
        for reply in reversed(replies):
            if isinstance(reply, dict):
                stack.append((reply, [*thread, (role, text)], deleted))
            else:
                yield Drop("malformed_message")


def _conversation_record(parsed: list[dict[str, Any]] | str, source: str,
                         tools: list[dict[str, Any]] | str | None = None) -> dict[str, Any] | Drop:
    """A conversation record, with the tool definitions it offers (record_tools'), or the Drop of the first
    problem."""
    for problem in (parsed, tools):
        if isinstance(problem, str):
            return Drop(problem)
    return {"messages": parsed, "source": source, **({"tools": tools} if tools else {})}


def _kept_or_dropped(parsed: dict[str, Any] | str) -> dict[str, Any] | Drop:
    return Drop(parsed) if isinstance(parsed, str) else parsed


def parse_record(obj: dict[str, Any], default_source: str, oasst: str = "paths") -> Iterator[dict[str, Any] | Drop]:
    """One input record -> records or Drops (at least one of either). `oasst` is how a tree is read: "paths",
    "best" (conversations), "pairs" (prompt/response) or "preferences" (pairs of ranked replies)."""
    try:
        source = obj["source"] if isinstance(obj.get("source"), str) else default_source
        is_tree = "message_tree_id" in obj or isinstance(obj.get("prompt"), dict) and "replies" in obj["prompt"]
        if is_tree and oasst == OASST_PREFERENCES:
            yield from map(_kept_or_dropped, oasst_preferences(obj))
        elif is_tree and oasst != "pairs":
            for parsed in oasst_threads(obj, oasst):
                yield _conversation_record(parsed, "oasst")
        elif is_tree:
            produced = False
            for item in _oasst_records(obj):
                produced = True
                yield item
            if not produced:
                yield Drop("no_pairs")
        elif is_preference(obj):  # before messages: UltraFeedback-binarized records have both
            yield _kept_or_dropped(preference_record(obj, source))
        elif "messages" in obj:
            yield _conversation_record(openai_messages(obj), source, record_tools(obj))
        elif "conversations" in obj:
            yield _conversation_record(sharegpt_messages(obj), source, record_tools(obj))
        elif "instruction" in obj and ("output" in obj or "input" in obj) and "response" not in obj:  # Alpaca
            yield _instruction_record(obj, "input", "output", source)
        elif "instruction" in obj:  # Dolly, whose category is the source
            category = obj.get("category")
            yield _instruction_record(obj, "context", "response", category if isinstance(category, str) else "dolly")
        elif "completion" in obj:
            yield _completion_record(obj, source)
        elif "prompt" in obj or "response" in obj:
            yield _gpt4all_record(obj, default_source)
        else:
            yield Drop("unknown_format")
    except Drop as drop:
        yield drop


def first_time(key: tuple, seen: set[bytes]) -> bool:
    """Whether `key` (what two duplicates share) is not yet in `seen`, which then holds it. `seen` keeps a 16-byte
    digest of each key, not the key: its memory grows by about 80 bytes a record, not by the records' text."""
    digest = hashlib.blake2b(json.dumps(key, ensure_ascii=False).encode("utf-8", "surrogatepass"),
                             digest_size=16).digest()
    if digest in seen:
        return False
    seen.add(digest)
    return True


def check_record(record: dict[str, Any], filters: Filters, seen: set[bytes]) -> str | None:
    """The drop reason for a parsed record, or None to keep it."""
    if "messages" in record:
        return check_conversation(record, filters, seen)
    if "chosen" in record:
        return check_preference(record, filters, seen)
    prompt, response = record["prompt"], record["response"]
    if not all(encodable(record[key]) for key in ("source", "prompt", "response")):
        return "invalid_unicode"
    if len(prompt.strip()) <= 1:
        return "short_prompt"
    if not response.strip():
        return "empty_response"
    filtered = filter_reason(response, filters)
    if filtered:
        return filtered
    key = (normalize_whitespace(prompt), normalize_whitespace(response))
    return None if first_time(key, seen) else "duplicate"


def check_conversation(record: dict[str, Any], filters: Filters, seen: set[bytes]) -> str | None:
    """The drop reason for a parsed conversation, or None to keep it. The optional filters read the trained assistant
    turns: a turn kept as context only ("train": false) teaches nothing, whatever it says."""
    if not encodable(record["source"]):
        return "invalid_unicode"
    answers = [m["content"] for m in record["messages"] if trained(m)]
    if filters.min_response_chars and any(len(a.strip()) < filters.min_response_chars for a in answers):
        return "short_response"
    if filters.drop_ai_disclaimers and any(AI_DISCLAIMER.search(a) for a in answers):
        return "ai_disclaimer"
    if filters.drop_refusals and any(REFUSAL.search(a) for a in answers):
        return "refusal"
    # Two conversations differ as well by their tool calls, reasoning and tools: none is a duplicate of the other.
    key = (*((m["role"], normalize_whitespace(m["content"]), json.dumps(m.get("tool_calls")),
              normalize_whitespace(m.get("reasoning_content") or "")) for m in record["messages"]),
           json.dumps(record.get("tools")))
    return None if first_time(key, seen) else "duplicate"


def check_prompt(record: dict[str, Any], seen: set[bytes]) -> str | None:
    """The drop reason for a prompt record (prompt_record's), or None to keep it: two records with the same prompt
    and fields are one prompt twice."""
    if not encodable(record["source"]):
        return "invalid_unicode"
    key = ("prompt", normalized(record["prompt"]),
           json.dumps({k: v for k, v in record.items() if k not in ("prompt", "source")}, sort_keys=True, default=str))
    return None if first_time(key, seen) else "duplicate"


def filter_reason(response: str, filters: Filters) -> str | None:
    """The optional filters' drop reason for an answer (too short, an AI disclaimer, a refusal), or None."""
    if filters.min_response_chars and len(response.strip()) < filters.min_response_chars:
        return "short_response"
    if filters.drop_ai_disclaimers and AI_DISCLAIMER.search(response):
        return "ai_disclaimer"
    if filters.drop_refusals and REFUSAL.search(response):
        return "refusal"
    return None


def check_preference(record: dict[str, Any], filters: Filters, seen: set[bytes]) -> str | None:
    """The drop reason for a parsed preference pair, or None to keep it. The optional filters read the chosen answer:
    the rejected one is expected to be poor, and a refusal is often exactly what it is."""
    if not encodable(record["source"]):
        return "invalid_unicode"
    filtered = filter_reason(answer_text(record["chosen"]), filters)
    if filtered:
        return filtered
    key = ("pair", *(normalized(record[name]) for name in PAIR_FIELDS))
    return None if first_time(key, seen) else "duplicate"


def written_fields(record: dict[str, Any]) -> dict[str, Any]:
    """What clean.py writes of a record: a conversation as {"messages", "source"} (and "tools" when it offers any), a
    preference pair as {"prompt", "chosen", "rejected", "source"}, a single turn as {"source", "prompt",
    "response"}."""
    if record.get("messages") is not None:
        keys: tuple[str, ...] = ("messages", "source", *(("tools",) if record.get("tools") else ()))
    elif record.get("chosen") is not None:
        keys = (*PAIR_FIELDS, "source")
    else:
        keys = ("source", "prompt", "response")
    return {key: record[key] for key in keys}


def record_line(record: dict[str, Any]) -> str:
    return json.dumps(written_fields(record), ensure_ascii=False) + "\n"


def dataset_row_record(row: dict[str, Any], default_source: str) -> dict[str, Any]:
    """The record clean.py wrote, from a row read back from a dataset: a column fills the rows (and, as a list of
    structs, the messages) that lack it with None, which clean.py never writes."""
    def unfilled(value: Any) -> Any:
        if isinstance(value, list):
            return [unfilled(item) for item in value]
        if isinstance(value, dict):
            return {key: unfilled(item) for key, item in value.items() if item is not None}
        return value

    record = {key: unfilled(value) for key, value in row.items() if value is not None}
    return written_fields({**record, "source": record.get("source", default_source)})


def reject_line(path: Path, unit: Unit, reason: str) -> str:
    """The line `--rejects` writes for a record dropped from `unit`: the file as given, the unit's line (data/
    raw_files.py), the reason, and the record read from it, or the unit's text when it holds none."""
    content = {"record": unit.record} if isinstance(unit.record, dict) else {"text": unit.text}
    line = {"file": str(path), "line": unit.number, "reason": reason, **content}
    text = json.dumps(line, ensure_ascii=False)
    # A lone surrogate (an invalid_unicode record) cannot be written as UTF-8; JSON's escape of it can.
    return (text if encodable(text) else json.dumps(line)) + "\n"


def clean_file(path: Path, out_path: Path, filters: Filters, seen: set[bytes], oasst: str = "paths",
               prompts: bool = False, rejects: IO[str] | None = None, near: NearDuplicates | None = None
               ) -> FileReport:
    """Clean one raw file (data/raw_files.py) into `out_path`, written atomically (temp file, fsync, rename); with
    `prompts`, every record as a prompt record. Each record dropped is written to `rejects` (reject_line). `near`
    drops the near-duplicates of records kept before (data/near_duplicates.py)."""
    report = FileReport()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out_path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for unit in read_units(path):
            report.lines += 1
            if isinstance(unit.record, str):
                items: Any = [Drop(unit.record)]
            else:
                items = [_kept_or_dropped(prompt_record(unit.record, path.stem))] if prompts else \
                    parse_record(unit.record, path.stem, oasst)
            for item in items:
                report.read += 1
                reason = item.reason if isinstance(item, Drop) else \
                    check_prompt(item, seen) if prompts else check_record(item, filters, seen)
                if not reason and near is not None and not near.first_of_its_kind(item):
                    reason = "near_duplicate"
                if reason:  # a Drop always has its reason
                    report.dropped[reason] += 1
                    if rejects is not None:
                        rejects.write(reject_line(path, unit, reason))
                    continue
                out.write(json.dumps(item, ensure_ascii=False) + "\n" if prompts else record_line(item))
                report.kept += 1
    return report


def input_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in SUFFIXES
                           and not p.name.endswith("_clean.jsonl") and p.name != REPORT_FILE)
            if not found:
                raise UserError(f"{path}: no data files in this folder ({', '.join(SUFFIXES)})")
            folders = [p for p in found if p.is_dir()]
            if folders:
                raise UserError(f"{folders[0]}: a folder named like a data file; rename it or move it out of {path}")
            files.extend(found)
        elif path.exists():  # a file, or a pipe such as bash's <(zcat data.jsonl.gz)
            files.append(path)
        else:
            raise UserError(f"{path}: no such file or folder")
    return files


def refuse_rejects_path(rejects: Path, inputs: list[str], files: list[Path], output_dir: Path) -> None:
    """A UserError for a --rejects file that is an input, that a later run of the same command would read as one (in
    an input folder), or that training would read as clean data (a *_clean.jsonl of output_dir)."""
    target = rejects.resolve()
    folders = [Path(name).resolve() for name in inputs if Path(name).is_dir()]
    if target in {file.resolve() for file in files} or (target.parent in folders and target.suffix.lower() in SUFFIXES
                                                        and target.name != REPORT_FILE):
        raise UserError(f"--rejects {rejects}: it would be read as an input; write it outside the input folders")
    if target.parent == output_dir.resolve() and target.name.endswith("_clean.jsonl"):
        raise UserError(f"--rejects {rejects}: training reads every *_clean.jsonl in {output_dir}; give it another "
                        f"name, such as rejects.jsonl")


def clean(inputs: list[str], output_dir: str | Path, filters: Filters | None = None, oasst: str = "paths",
          oasst_preferences: bool = False, prompts: bool = False, rejects: str | Path | None = None,
          near_duplicates: float | None = None) -> dict[str, Any]:
    """Clean every input into `output_dir/<name>_clean.jsonl` and write `clean_report.json`. Returns the report.

    `oasst`: OpenAssistant trees as every thread ("paths"), the best-ranked thread ("best"), prompt/response
    pairs ("pairs"); or, with `oasst_preferences`, as preference pairs of ranked sibling replies (the report's oasst
    then says "preferences"). `prompts`: every record as a prompt with its fields (objective grpo). `rejects`: a
    JSONL file of every record dropped (reject_line), one line per drop, in the order they were read.
    `near_duplicates`: drop a record whose text is at least this similar to one kept before it (estimated Jaccard
    similarity of word 3-grams, data/near_duplicates.py), as `near_duplicate`; None keeps them."""
    if near_duplicates is not None and not 0 < near_duplicates <= 1:
        raise UserError(f"--near-duplicates: a similarity above 0 and at most 1 (0.9 drops records that share 90% "
                        f"of their word 3-grams with one kept before), got {near_duplicates}")
    if oasst not in OASST_MODES:
        raise UserError(f"--oasst: must be one of {', '.join(OASST_MODES)}, got {oasst!r}")
    if prompts and (oasst_preferences or oasst != "paths" or filters is not None and filters != Filters()):
        raise UserError("--prompts: reads every record as a prompt, which the OpenAssistant modes and the answer "
                        "filters (they read answers) would contradict; give --prompts alone")
    if oasst_preferences:
        if oasst != "paths":
            raise UserError(f"--oasst-preferences: reads trees as pairs of ranked replies, which --oasst {oasst} "
                            f"would contradict; give one of the two")
        oasst = OASST_PREFERENCES
    filters = filters or Filters()
    output_dir = Path(output_dir)
    seen: set[bytes] = set()
    files = input_files(inputs)
    outputs: dict[Path, Path] = {}
    for path in files:
        out_path = output_dir / f"{path.stem}_clean.jsonl"
        if out_path in outputs:
            raise UserError(f"{path}: would overwrite the output of {outputs[out_path]} ({out_path}); "
                            f"clean files with the same name into separate --output-dir folders")
        outputs[out_path] = path
    if rejects is not None:
        rejects = Path(rejects)
        refuse_rejects_path(rejects, inputs, files, output_dir)
    report: dict[str, Any] = {"files": {}, "filters": vars(filters), "oasst": oasst, "prompts": prompts,
                              "near_duplicates": near_duplicates}
    near = NearDuplicates(near_duplicates) if near_duplicates is not None else None
    with ExitStack() as stack:
        rejected = None
        if rejects is not None:
            rejects.parent.mkdir(parents=True, exist_ok=True)
            rejected = stack.enter_context(open(stack.enter_context(atomic_file(rejects)), "w", encoding="utf-8"))
            report["rejects"] = str(rejects)
        for out_path, path in outputs.items():
            report["files"][str(path)] = clean_file(path, out_path, filters, seen, oasst, prompts,
                                                    rejected, near).to_dict()
    totals: Counter[str] = Counter()
    for entry in report["files"].values():
        totals.update({key: entry[key] for key in ("lines", "read", "kept")})
        totals.update({f"dropped:{k}": v for k, v in entry["dropped"].items()})
    report["total"] = dict(totals)
    atomic_write(output_dir / REPORT_FILE, json.dumps(report, indent=2))
    return report
