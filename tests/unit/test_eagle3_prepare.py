"""prepare: loss masks on real chat templates, with a tokenizer trained and saved locally."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from vllm_compat.eagle3.prepare import (
    PREPARED,
    REPORT,
    SKIPPED,
    iter_token_records,
    load_tokenizer,
    prepare,
)

CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# renders differently depending on the last message: assistant turns cannot be located
UNSTABLE = "{% if messages[-1]['role'] == 'assistant' %}[done]{% endif %}" + CHATML

CORPUS = [
    "Hello there, how are you today?", "I am fine, thank you very much.", "What is the capital of France?",
    "Paris is the capital of France.", "Tell me a joke about numbers 1 2 3.", "system user assistant",
] * 4


def _tokenizer(path, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("chatml"), CHATML)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("llama3"), LLAMA3)


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _masked_text(tok, row):
    return tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])


def _rows(out):
    return [json.loads(line) for line in (out / PREPARED).read_text().splitlines()]


CHAT = {"messages": [
    {"role": "system", "content": "system"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": "numbers 1 2 3"},
]}


def test_chatml_mask_covers_exactly_the_assistant_turns(chatml, tmp_path):
    rep = prepare(_write(tmp_path / "in.jsonl", [CHAT]), chatml, tmp_path / "out")
    assert rep.kept == 1 and not rep.skipped
    row = _rows(tmp_path / "out")[0]
    tok = load_tokenizer(chatml)
    assert _masked_text(tok, row) == "Paris is the capital of France.<|im_end|>\nnumbers 1 2 3<|im_end|>\n"
    assert tok.decode(row["input_ids"]) == tok.apply_chat_template(CHAT["messages"], tokenize=False)
    assert len(row["input_ids"]) == len(row["loss_mask"])


def test_llama3_template_mask(llama3, tmp_path):
    prepare(_write(tmp_path / "in.jsonl", [CHAT]), llama3, tmp_path / "out")
    row = _rows(tmp_path / "out")[0]
    tok = load_tokenizer(llama3)
    assert _masked_text(tok, row) == "Paris is the capital of France.<|eot_id|>numbers 1 2 3<|eot_id|>"
    assert row["input_ids"][0] == tok.convert_tokens_to_ids("<s>")  # template's BOS, not a doubled one
    assert row["input_ids"][1] != row["input_ids"][0]


def test_sharegpt_and_completion_records(chatml, tmp_path):
    sharegpt = {"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "I am fine"}]}
    completion = {"prompt": "What is the capital of France? ", "completion": "Paris"}
    straddling = {"prompt": "Hello ", "completion": "there"}  # " there" is one token across the boundary
    prepare(_write(tmp_path / "in.jsonl", [sharegpt, completion, straddling]), chatml, tmp_path / "out")
    rows = _rows(tmp_path / "out")
    tok = load_tokenizer(chatml)
    assert _masked_text(tok, rows[0]) == "I am fine<|im_end|>\n"
    assert _masked_text(tok, rows[1]) == "Paris"
    assert _masked_text(tok, rows[2]) == " there" and rows[2]["loss_mask"][0] == 0


def test_every_skip_is_counted_with_its_reason(chatml, tmp_path):
    long_chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello " * 200}]}
    records = [
        CHAT,
        "{not json",
        json.dumps([1, 2]),
        {"messages": [{"role": "user"}]},
        {"text": "no known fields"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
        "",
        long_chat,
        {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "ok"}]},
    ]
    rep = prepare(_write(tmp_path / "in.jsonl", records), chatml, tmp_path / "out", max_length=64)
    assert rep.kept == 1
    assert dict(rep.skipped) == {"malformed_json": 1, "malformed_record": 3, "empty": 2, "too_long": 1,
                                 "template_error": 1}
    skipped = [json.loads(line) for line in (tmp_path / "out" / SKIPPED).read_text().splitlines()]
    assert [s["line"] for s in skipped] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert json.loads((tmp_path / "out" / REPORT).read_text())["skipped_total"] == 8


def test_prefix_unstable_template_is_reported(tmp_path):
    tok = _tokenizer(tmp_path / "tok", UNSTABLE)
    rep = prepare(_write(tmp_path / "in.jsonl", [CHAT]), tok, tmp_path / "out")
    assert rep.kept == 0 and dict(rep.skipped) == {"template_error": 1}


def test_resume_continues_and_matches_a_single_run(chatml, tmp_path):
    records = [CHAT, "{bad", {"prompt": "a ", "completion": "Paris"}, CHAT]
    once = prepare(_write(tmp_path / "all.jsonl", records), chatml, tmp_path / "once")
    prepare(_write(tmp_path / "part.jsonl", records[:2]), chatml, tmp_path / "twice")
    # a crash mid-write leaves a torn line: resume drops it and redoes that record
    with (tmp_path / "twice" / PREPARED).open("a") as f:
        f.write('{"line": 3, "input_ids": [1, 2')
    twice = prepare(tmp_path / "all.jsonl", chatml, tmp_path / "twice")
    assert (tmp_path / "once" / PREPARED).read_text() == (tmp_path / "twice" / PREPARED).read_text()
    assert once.to_json() == twice.to_json()
    pairs = list(iter_token_records(tmp_path / "twice"))
    assert len(pairs) == 3 and all(ids.shape == mask.shape for ids, mask in pairs)


def test_chat_template_override_from_a_file(chatml, tmp_path):
    (tmp_path / "llama3.jinja").write_text(LLAMA3)
    prepare(_write(tmp_path / "in.jsonl", [CHAT]), chatml, tmp_path / "out",
            chat_template=str(tmp_path / "llama3.jinja"))
    row = _rows(tmp_path / "out")[0]
    assert _masked_text(load_tokenizer(chatml), row) == "Paris is the capital of France.<|eot_id|>numbers 1 2 3<|eot_id|>"
