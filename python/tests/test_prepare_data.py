"""test_tokenize.py — train/tokenize.py on a tokenizer built here: a byte-level BPE trained on a
few sentences, Gemma's special tokens (pad 0, eos 1, bos 2, <start_of_turn>, <end_of_turn>) and a
Gemma-style Jinja chat template that also renders "tools" and enable_thinking. Checks token ids
against the tokenizer called directly, the masks of text, prompt/completion and chat records (with
and without --mask-prompt), against mlx-lm's own datasets when mlx-lm is installed, that
`winattn train` loads the output and counts exactly the masked targets, and one-line errors
naming file:line that leave --out as it was. SKIPs without transformers and tokenizers.
Run from the repository root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_tokenize.py
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, finish, report, skip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "train", "tokenize.py")
FIXTURE = os.path.join(ROOT, "train", "fixtures", "gemma4_smoke")  # vocab 512, above the tokenizer's

TEMPLATE = (
    "{{ bos_token }}{% if enable_thinking %}<|channel>{% endif %}"
    "{% if tools %}<start_of_turn>system\ntools: {% for t in tools %}{{ t['name'] }} {% endfor %}"
    "<end_of_turn>\n{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Sliding-window attention keeps each query within a window of keys.",
    "What is the capital of France? Paris is the capital of France.",
    "Write a haiku about autumn leaves falling on a quiet pond.",
]

TRAIN = [  # chat first: the file's kind
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Italy?"},
                  {"role": "assistant", "content": "Rome, the capital of Italy."}]},
    {"messages": [{"role": "user", "content": "Write a haiku."},
                  {"role": "assistant", "content": "Leaves fall on the pond."}],
     "tools": [{"name": "lookup", "description": "finds a word"}]},
    {"messages": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "the quick fox"}]},
]
VALID = [
    {"prompt": "What is the capital of France?", "completion": "Paris is the capital."},
    {"prompt": "Name a dog.", "completion": "The lazy dog."},
    {"prompt": "Say the window.", "completion": "sliding window", "tools": [{"name": "search"}]},
]
TEST = [{"text": "The quick brown fox jumps."}, {"text": "over the lazy dog<eos>"}, {"text": ""}]


def have_modules():
    missing = [m for m in ("transformers", "tokenizers", "jinja2") if importlib.util.find_spec(m) is None]
    return missing


def build_checkpoint(d):
    """config.json and model.safetensors of the gemma4_smoke fixture, and the tokenizer here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<|channel>", "<channel|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 2)])
    assert [tok.token_to_id(s) for s in specials[:3]] == [0, 1, 2]
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": TEMPLATE}, f)
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(FIXTURE, name), os.path.join(d, name))


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT)


def expected(tok, rec, kind, mask_prompt):
    """Tokens and mask from the tokenizer directly, as mlx-lm 0.32.2's datasets define them."""
    extra = {"enable_thinking": True}  # the vocabulary has <|channel> and <channel|>
    if kind == "text":
        ids = tok.encode(rec["text"])
        ids = ids if ids and ids[-1] == tok.eos_token_id else ids + [tok.eos_token_id]
        return ids, [1] * len(ids)
    if kind == "completion":
        msgs = [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["completion"]}]
        gen = True
    else:
        msgs, gen = rec["messages"], rec["messages"][-1]["role"] == "assistant"
    ids = list(tok.apply_chat_template(msgs, tools=rec.get("tools"), return_dict=False, **extra))
    off = len(tok.apply_chat_template(msgs[:-1], tools=rec.get("tools"), add_generation_prompt=gen,
                                      return_dict=False, **extra)) if mask_prompt else 0
    return ids, [int(i >= off) for i in range(len(ids))]


def winattn_binary():
    lib = os.environ.get("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))
    exe = os.path.join(os.path.dirname(os.path.abspath(lib)), "winattn")
    return exe if os.access(exe, os.X_OK) else None


def main():
    missing = have_modules()
    if missing:
        skip("tokenize", "needs %s (pip install transformers tokenizers jinja2)" % ", ".join(missing))
        return
    import warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # PyTorch's absence does not matter here
    from transformers import AutoTokenizer

    tmp = tempfile.TemporaryDirectory(prefix="winattn-tokenize-")
    ck, data, out = (os.path.join(tmp.name, n) for n in ("ck", "data", "out"))
    for d in (ck, data):
        os.mkdir(d)
    build_checkpoint(ck)
    write_jsonl(os.path.join(data, "train.jsonl"), TRAIN)
    write_jsonl(os.path.join(data, "valid.jsonl"), VALID)
    write_jsonl(os.path.join(data, "test.jsonl"), TEST)
    tok = AutoTokenizer.from_pretrained(ck)
    splits = (("train", TRAIN, "chat"), ("valid", VALID, "completion"), ("test", TEST, "text"))

    r = run_script("--model", ck, "--data", data, "--out", out)
    report(r.returncode == 0 and all(os.path.exists(os.path.join(out, s + ".jsonl")) for s, _, _ in splits),
           "tokenize folder: train, valid, test written", r.stderr.strip()[-300:])

    for mask_prompt in (True, False):
        if not mask_prompt:
            r = run_script("--model", ck, "--data", data, "--out", out, "--no-mask-prompt")
        for split, recs, kind in splits:
            @case("tokenize %s %s%s" % (split, kind, "" if mask_prompt else " --no-mask-prompt"))
            def _():
                got = read_jsonl(os.path.join(out, split + ".jsonl"))
                assert len(got) == len(recs), "%d records, expected %d" % (len(got), len(recs))
                for i, (g, rec) in enumerate(zip(got, recs)):
                    ids, mask = expected(tok, rec, kind, mask_prompt)
                    assert g["tokens"] == ids, "record %d: tokens differ from the tokenizer's" % i
                    assert g["mask"] == mask, "record %d: mask %s, expected %s" % (i, g["mask"], mask)
                report(True, "tokenize %s %s%s" % (split, kind, "" if mask_prompt else " --no-mask-prompt"),
                       "records=%d tokens=%d targets=%d" % (len(got), sum(len(g["tokens"]) for g in got),
                                                            sum(sum(g["mask"][1:]) for g in got)))

    # What the masks select, decoded: the completion, or the last message, with its turn's end.
    run_script("--model", ck, "--data", data, "--out", out)

    @case("tokenize masks select the completion and the last message")
    def _():
        def targets(split, i):
            g = read_jsonl(os.path.join(out, split + ".jsonl"))[i]
            return tok.decode([t for t, m in zip(g["tokens"], g["mask"]) if m])
        checks = [(targets("valid", 0), "Paris is the capital.<end_of_turn>\n"),
                  (targets("train", 0), "Rome, the capital of Italy.<end_of_turn>\n"),
                  (targets("train", 1), "Leaves fall on the pond.<end_of_turn>\n"),
                  (targets("train", 2), "<start_of_turn>user\nthe quick fox<end_of_turn>\n")]
        for got, want in checks:
            assert got == want, "targets %r, expected %r" % (got, want)
        g = read_jsonl(os.path.join(out, "test.jsonl"))
        assert g[1]["tokens"].count(tok.eos_token_id) == 1, "a text ending in EOS got a second one"
        assert g[2]["tokens"] == [tok.bos_token_id, tok.eos_token_id], "empty text: %s" % g[2]["tokens"]
        assert not [n for n in os.listdir(out) if n.endswith(".tmp")], "temporary files left in --out"
        report(True, "tokenize masks select the completion and the last message")

    mlx_lm_check(ck, out)
    trainer_check(ck, out)
    error_checks(ck, data, out, tmp.name)
    tmp.cleanup()


def mlx_lm_check(ck, out):
    """The same records through mlx-lm's own datasets (mask_prompt on), where mlx-lm is installed."""
    try:
        from types import SimpleNamespace
        from pathlib import Path
        from mlx_lm.tokenizer_utils import load as load_tokenizer
        from mlx_lm.tuner.datasets import create_dataset
    except Exception as e:  # mlx-lm or mlx missing, or an mlx-lm without these names
        skip("tokenize against mlx-lm's datasets", "mlx-lm not importable (%s)" % type(e).__name__)
        return

    @case("tokenize against mlx-lm's datasets")
    def _():
        wrapper = load_tokenizer(Path(ck))
        for split, recs, masked in (("train", TRAIN, True), ("valid", VALID, True), ("test", TEST, False)):
            ds = create_dataset([dict(r) for r in recs], wrapper, SimpleNamespace(mask_prompt=masked))
            got = read_jsonl(os.path.join(out, split + ".jsonl"))
            for i in range(len(recs)):
                ids, off = ds.process(ds[i])
                assert got[i]["tokens"] == list(ids), "%s record %d: tokens differ from mlx-lm's" % (split, i)
                assert got[i]["mask"] == [int(j >= off) for j in range(len(ids))], \
                    "%s record %d: mask differs from mlx-lm's offset %d" % (split, i, off)
        report(True, "tokenize against mlx-lm's datasets", "chat, prompt/completion, text")


def trainer_check(ck, out):
    exe = winattn_binary()
    if not exe:
        skip("tokenize output through winattn train", "no winattn beside WINATTN_LIBRARY (run make)")
        return

    @case("tokenize output through winattn train")
    def _():
        # valid.jsonl's 3 records are one batch, so the evaluation counts every masked target
        want = sum(sum(g["mask"][1:]) for g in read_jsonl(os.path.join(out, "valid.jsonl")))
        r = subprocess.run([exe, "train", "--model", ck, "--data", out, "--iters", "1", "--batch-size", "3",
                            "--lora-rank", "4", "--threads", "1", "--eval"], capture_output=True, text=True)
        m = re.search(r"^eval after training: held-out loss [0-9.]+ over (\d+) tokens", r.stdout, re.M)
        ok = r.returncode == 0 and "step 1/1" in r.stdout and m and int(m.group(1)) == want
        report(bool(ok), "tokenize output through winattn train", "eval targets=%s expected=%d %s" % (
            m.group(1) if m else "?", want, r.stderr.strip()[-200:]))


def error_checks(ck, data, out, tmp):
    """In this process (the script's main), to spare a transformers import per case."""
    import contextlib
    import io
    spec = importlib.util.spec_from_file_location("winattn_tokenize", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def run_script(*args):  # noqa: F811 (the subprocess one's result, from main in this process)
        so, se = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            rc = script.main(list(args))
        return subprocess.CompletedProcess(args, rc, so.getvalue(), se.getvalue())

    before = {n: open(os.path.join(out, n)).read() for n in os.listdir(out)}

    def bad(name, lines, where, text):
        d = os.path.join(tmp, "bad-" + name)
        os.mkdir(d)
        with open(os.path.join(d, "train.jsonl"), "w") as f:
            f.write("\n".join(lines) + "\n")
        r = run_script("--model", ck, "--data", d, "--out", out)
        err = r.stderr.strip()
        after = {n: open(os.path.join(out, n)).read() for n in os.listdir(out)}
        ok = (r.returncode != 0 and len(err.splitlines()) == 1 and (os.path.join(d, "train.jsonl") + where) in err
              and text in err and after == before)
        report(ok, "tokenize refuses %s" % name, err)

    chat = json.dumps(TRAIN[1])
    bad("invalid JSON", [chat, "{not json"], ":2:", "not valid JSON")
    bad("a text record in a chat file", [chat, '{"text": "hello"}'], ":2:", '"messages"')
    bad("a record of no known kind", ['{"input": "x"}'], ":1:", "mlx-lm's formats")
    bad("a message without content", [chat, chat, '{"messages": [{"role": "user"}]}'], ":3:", "messages[0]")
    bad("a non-object record", ["[1, 2]"], ":1:", "JSON object")
    bad("a completion that is not a string", ['{"prompt": "a", "completion": 3}'], ":1:", '"completion"')
    empty = os.path.join(tmp, "empty")
    os.mkdir(empty)
    r = run_script("--model", ck, "--data", empty, "--out", out)
    report(r.returncode != 0 and "no train.jsonl" in r.stderr, "tokenize refuses a folder without splits",
           r.stderr.strip())
    r = run_script("--model", ck, "--data", os.path.join(data, "valid.jsonl"), "--out", data)
    report(r.returncode != 0 and "replace the input" in r.stderr, "tokenize refuses --out over its input",
           r.stderr.strip())
    r = run_script("--model", ck, "--data", os.path.join(data, "test.jsonl"), "--out", os.path.join(tmp, "one"))
    report(r.returncode == 0 and os.path.exists(os.path.join(tmp, "one", "test.jsonl")),
           "tokenize one file", r.stderr.strip()[-200:])


if __name__ == "__main__":
    main()
    finish()
