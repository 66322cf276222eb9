"""Hugging Face tokenizers from local directories: the engines' surface, chat templates, special
ids from tokenizer/config files, offline loading and one-line errors. Tokenizers are trained here
with the ``tokenizers`` library (no downloads)."""

import json
import os
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from rltpu.data.chat_example import CHATML_TEMPLATE, make_tiny_tokenizer  # noqa: E402
from rltpu.config import ConfigError, build_config  # noqa: E402
from rltpu.data.sources import build_tokenizer, resolve_vocab, with_tokenizer_stops  # noqa: E402
from rltpu.data.hf_tokenizer import HFTokenizer, TokenizerError  # noqa: E402
from rltpu.data.char_tokenizer import CharTokenizer  # noqa: E402

CORPUS = ["Repeat: 1 2 3", "What is 2 + 3?", "The answer is 5.", "hello world", "user assistant system"] * 4


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), CORPUS)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return HFTokenizer(tok_dir)


def test_round_trip_and_engine_surface(tok):
    """Byte-level BPE: any text (including unseen characters) decodes back exactly."""
    for text in ["Repeat: 1 2 3", "What is 12 + 30?", "ünïcode ✓ and\nnewlines  double  spaces"]:
        ids = tok.encode(text, add_bos=False)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode("hello world", add_bos=False)) < len("hello world")  # merges were learned
    assert tok.bos_id is None and tok.encode("hi") == tok.encode("hi", add_bos=False)  # ChatML: no BOS
    assert tok.vocab_size == len(json.loads((tok.directory / "tokenizer.json").read_text())["model"]["vocab"])


def test_bos_is_added_once(tmp_path):
    """add_bos prepends BOS for text prompts but not when the text already starts with it."""
    t = HFTokenizer(make_tiny_tokenizer(tmp_path, CORPUS, bos_token="<s>"))
    ids = t.encode("hello")
    assert ids[0] == t.bos_id and ids[1:] == t.encode("hello", add_bos=False)
    assert t.encode("<s>hello") == ids


def test_chat_template_equals_hand_written_string(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n"
                "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages) == expected
    ids = tok.encode(expected, add_bos=False)
    # special tokens are single ids, not spelled out byte by byte
    assert ids.count(tok._tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tok.eos_id) == 2


def test_eos_pad_and_stop_ids_from_files(tok, tmp_path):
    """eos/pad from the tokenizer, extra EOS ids from generation_config.json become stop ids."""
    t = tok._tok
    assert tok.eos_id == t.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_id == t.convert_tokens_to_ids("<|endoftext|>")
    assert tok.stop_ids == (tok.eos_id, tok.pad_id)
    # no pad anywhere: pad falls back to eos
    no_pad = HFTokenizer(make_tiny_tokenizer(tmp_path / "a", CORPUS, pad_token=None, generation_eos=None))
    assert no_pad.pad_id == no_pad.eos_id and no_pad.stop_ids == (no_pad.eos_id,)
    # no eos in the tokenizer config: the first generation_config eos becomes eos
    gen_only = HFTokenizer(make_tiny_tokenizer(tmp_path / "b", CORPUS, eos_token=None,
                                               generation_eos=["<|endoftext|>", "<|im_end|>"]))
    assert gen_only.eos_id == gen_only._tok.convert_tokens_to_ids("<|endoftext|>")
    assert set(gen_only.stop_ids) == {gen_only.eos_id, gen_only._tok.convert_tokens_to_ids("<|im_end|>")}
    with pytest.raises(TokenizerError, match="defines no EOS token"):
        HFTokenizer(make_tiny_tokenizer(tmp_path / "c", CORPUS, eos_token=None, generation_eos=None))


def test_decode_cuts_at_any_stop_id_and_shows_other_specials(tok):
    body = tok.encode("1 2", add_bos=False)
    assert tok.decode([*body, tok.eos_id, *body]) == "1 2"
    assert tok.decode([*body, tok.pad_id, *body]) == "1 2"  # the generation_config's second EOS
    start = tok._tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode([start, *body]) == "<|im_start|>1 2"  # visible to the reward
    assert tok.decode([start, *body], show_special=False) == "1 2"
    assert tok.decode([*body, tok.eos_id], stop_at_eos=False).endswith("<|im_end|>")


def test_loading_is_offline_and_bad_dirs_are_one_line(tok, tmp_path):
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    for bad, msg in [(tmp_path / "nope", "does not exist"), (tmp_path, "no tokenizer.json")]:
        with pytest.raises(TokenizerError, match=msg) as err:
            HFTokenizer(bad)
        assert "\n" not in str(err.value) and str(bad) in str(err.value)
    # a hub-style name that is not a local directory is never looked up online
    with pytest.raises(TokenizerError, match="does not exist"):
        HFTokenizer("Qwen/Qwen2-0.5B-Instruct")
    broken = make_tiny_tokenizer(tmp_path / "broken", CORPUS)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load the tokenizer") as err:
        HFTokenizer(broken)
    assert "\n" not in str(err.value)
    (broken / "tokenizer.json").unlink()
    bad_gen = make_tiny_tokenizer(tmp_path / "badgen", CORPUS)
    (bad_gen / "generation_config.json").write_text('{"eos_token_id": [1,')
    with pytest.raises(TokenizerError, match=r"generation_config.json: not valid JSON at line 1"):
        HFTokenizer(bad_gen)


def test_missing_chat_template_is_a_clear_error(tmp_path):
    t = HFTokenizer(make_tiny_tokenizer(tmp_path, CORPUS, chat_template=None))
    with pytest.raises(TokenizerError, match="has no chat_template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_transformers_is_one_line(tok_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    with pytest.raises(TokenizerError, match=r"pip install 'rltpu\[hf\]'"):
        HFTokenizer(tok_dir)


def test_build_tokenizer_resolution(tok_dir, tmp_path):
    """task.tokenizer wins; else model.path (the HF-model hook); else the built-in char tokenizer."""
    assert isinstance(build_tokenizer(build_config({})), CharTokenizer)
    cfg = build_config({"task": {"tokenizer": str(tok_dir)}})
    assert isinstance(build_tokenizer(cfg), HFTokenizer)
    model_dir = make_tiny_tokenizer(tmp_path / "model", CORPUS, chat_template=CHATML_TEMPLATE + " ")
    fake = SimpleNamespace(task=SimpleNamespace(tokenizer=None), model=SimpleNamespace(path=str(model_dir)))
    assert build_tokenizer(fake).directory == model_dir
    fake.task.tokenizer = str(tok_dir)
    assert build_tokenizer(fake).directory == tok_dir


def test_stop_ids_reach_the_sampler_config_and_vocab_check(tok, tok_dir):
    cfg = build_config({"task": {"tokenizer": str(tok_dir)}, "sampler": {"stop_token_ids": [7]}})
    merged = with_tokenizer_stops(cfg, tok)
    assert merged.sampler.stop_token_ids == (7, tok.pad_id)  # eos is the sampler's own stop already
    assert with_tokenizer_stops(merged, tok) is merged  # idempotent (a resumed config)
    assert resolve_vocab(cfg, tok) == tok.vocab_size
    assert resolve_vocab(build_config({"model": {"vocab_size": 512}}), tok) == 512
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        resolve_vocab(build_config({"model": {"vocab_size": 16}}), tok)


def test_save_copies_the_tokenizer_files(tok, tmp_path):
    tok.save(tmp_path / "export")
    again = HFTokenizer(tmp_path / "export")
    assert again.stop_ids == tok.stop_ids and again.encode("Repeat: 1 2") == tok.encode("Repeat: 1 2")
    assert again.chat_template == tok.chat_template
