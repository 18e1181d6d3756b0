#!/usr/bin/env python3
"""prepare_data.py — mlx-lm's LoRA data (JSONL) turned into `winattn train`'s token records, with the
checkpoint's own tokenizer and chat template, tokenised as mlx-lm 0.32.2 does
(mlx_lm/tuner/datasets.py; mlx_lm/tokenizer_utils.py for the chat-template arguments).

    python3 train/prepare_data.py --model CHECKPOINT_DIR --data IN_DIR_OR_FILE --out OUT [--mask-prompt | --no-mask-prompt]

--data is a folder holding train.jsonl, valid.jsonl and/or test.jsonl (mlx-lm's data folder;
each one present is converted into OUT, a folder, under the same name), or one .jsonl file (into
OUT/<its name>, or into OUT itself when OUT ends in .jsonl and is not a folder). One record per
line, as train/data.h reads them:

    {"tokens": [2, 106, ...], "offset": 14}

"offset" is the prompt's token count: `winattn train --mask-prompt` trains token i only where
i >= offset, as mlx-lm's loss does under its --mask-prompt; without it every token is a target (so
the choice stays the trainer's, as in mlx-lm). The record kinds, decided as mlx-lm decides them, by
the file's first record ("prompt" and "completion" before "messages" before "text"); every later
record must be of the same kind:

- {"text": "..."}: tokenizer.encode(text) (the tokenizer's own special tokens, so BOS for Gemma),
  then EOS appended unless it already ends the sequence. No offset: every token is a target, and
  the trainer refuses --mask-prompt on such a file, as mlx-lm refuses it on text data.
- {"prompt": "...", "completion": "..."}: the chat [user: prompt, assistant: completion] through
  tokenizer.apply_chat_template. The offset is len(apply_chat_template([user: prompt],
  add_generation_prompt=True)): the targets under --mask-prompt are the completion and the
  template's closing tokens.
- {"messages": [{"role": ..., "content": ...}, ...]}: the whole chat through
  apply_chat_template. The offset is len(apply_chat_template(messages[:-1],
  add_generation_prompt=<last role is "assistant">)): the last message only (with its turn's
  closing tokens). Earlier assistant turns are context, not targets, exactly as mlx-lm 0.32.2 masks
  them.

Both chat kinds pass the record's optional "tools" to the template, and enable_thinking=True when
the vocabulary has thinking tokens (Gemma 4's <|channel>/<channel|>), as mlx-lm's tokenizer
wrapper does. mlx-lm masks by the prompt's token count even where the prompt's tokens are not a
prefix of the whole chat's (a template that renders earlier turns differently once another
follows); so does this script, and it says on stderr how many records that was.

--mask-prompt writes the mask into the records instead ({"tokens", "mask"}, 1 where a token is a
target), so the prompt is masked whatever the trainer is told; --no-mask-prompt writes no offset,
so every token is a target. The records are not truncated: `winattn train --max-seq-length` does
that, as mlx-lm does at batch time. Errors are one line naming the file and line; nothing is
written unless every file converts, and each output is written to a temporary file beside it and
renamed into place.
"""
import os
import sys

# transformers' advice that PyTorch is absent (only the tokenizer is needed) would make every
# error message two lines
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse  # noqa: E402 (after the environment above)
import json  # noqa: E402
import tempfile  # noqa: E402

SPLITS = ("train", "valid", "test")  # mlx-lm's data folder


class DataError(Exception):
    """A one-line problem with the input, already naming the file (and line)."""


def thinking_kwargs(tokenizer):
    """What mlx-lm's TokenizerWrapper.apply_chat_template adds: enable_thinking (or the tokenizer's
    own "thinking" argument) set to whether the vocabulary has thinking tokens."""
    vocab = tokenizer.get_vocab()
    pairs = [("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"),
             ("<|think:start|>", "<|think:end|>"), ("<|channel>", "<channel|>")]
    has_thinking = (any(a in vocab and b in vocab for a, b in pairs) or
                    all(t in vocab for t in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")))
    name = "enable_thinking"
    from transformers import PreTrainedTokenizerBase
    own = getattr(type(tokenizer), "apply_chat_template", None)
    if own is not PreTrainedTokenizerBase.apply_chat_template:
        import inspect
        try:
            params = inspect.signature(own).parameters
            if "thinking" in params and "enable_thinking" not in params:
                name = "thinking"
        except (ValueError, TypeError):
            pass
    return {name: has_thinking}


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kind = tokenizer.init_kwargs.get("chat_template_type")
    if kind:
        raise DataError("%s: chat_template_type %r is rendered by mlx-lm's own Python template, which this "
                        "script does not reproduce" % (model_dir, kind))
    return tokenizer


def record_kind(rec):
    """mlx-lm's create_dataset order, applied to the first record."""
    if "prompt" in rec and "completion" in rec:
        return "completion"
    if "messages" in rec:
        return "chat"
    if "text" in rec:
        return "text"
    return None


def check_record(rec, kind):
    """A message for a record mlx-lm's dataset of this kind could not process, or None."""
    if kind == "text":
        return None if isinstance(rec.get("text"), str) else 'needs "text", a string (the file\'s first record is text)'
    if kind == "completion":
        for key in ("prompt", "completion"):
            if not isinstance(rec.get(key), str):
                return 'needs "%s", a string (the file\'s first record is prompt/completion)' % key
    else:
        msgs = rec.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return 'needs "messages", a non-empty list (the file\'s first record is a chat)'
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                return "messages[%d] needs a \"role\" string and a \"content\"" % i
    tools = rec.get("tools")
    if tools is not None and not isinstance(tools, list):
        return '"tools" must be a list'
    return None


def template(tokenizer, messages, tools, extra, **kw):
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **extra, **kw)
    return list(ids)


def tokenize_record(tokenizer, rec, kind, extra):
    """(tokens, offset, prefix_matches): under mask_prompt token i is a target where i >= offset, as
    in mlx-lm's loss (mlx_lm/tuner/trainer.py, default_loss: steps >= offset); offset is None for
    text, which has no prompt."""
    if kind == "text":
        ids = list(tokenizer.encode(rec["text"]))
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
        return ids, None, True
    tools = rec.get("tools")
    if kind == "completion":
        messages = [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["completion"]}]
        generation_prompt = True
    else:
        messages = rec["messages"]
        generation_prompt = messages[-1].get("role") == "assistant"
    ids = template(tokenizer, messages, tools, extra)
    prompt = template(tokenizer, messages[:-1], tools, extra, add_generation_prompt=generation_prompt)
    return ids, len(prompt), ids[:len(prompt)] == prompt


def record_line(ids, offset, mask_prompt):
    """The output record: the prompt's length as "offset" (mask_prompt None: the trainer decides),
    baked into a "mask" (True), or left out (False)."""
    rec = {"tokens": ids}
    if offset is not None and mask_prompt is None:
        rec["offset"] = offset
    elif offset is not None and mask_prompt:
        rec["mask"] = [1 if i >= offset else 0 for i in range(len(ids))]
    return json.dumps(rec, separators=(",", ":")) + "\n"


def convert(tokenizer, path, mask_prompt, notes):
    """Every record of path as a line of output; raises DataError naming path:line."""
    extra = thinking_kwargs(tokenizer)
    if tokenizer.eos_token_id is None:
        raise DataError("%s: the tokenizer has no EOS token, which text records end with" % path)
    out, kind, mismatched, untrained, top = [], None, 0, 0, 0
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError("%s: cannot open (%s)" % (path, e.strerror))
    with f:
        for lineno, line in enumerate(f, 1):
            where = "%s:%d" % (path, lineno)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError("%s: not valid JSON (%s)" % (where, e))
            if not isinstance(rec, dict):
                raise DataError("%s: a record must be a JSON object" % where)
            if kind is None:
                kind = record_kind(rec)
                if kind is None:
                    raise DataError('%s: a record needs "text", "prompt" and "completion", or "messages" '
                                    "(mlx-lm's formats)" % where)
            problem = check_record(rec, kind)
            if problem:
                raise DataError("%s: %s" % (where, problem))
            try:
                ids, offset, matches = tokenize_record(tokenizer, rec, kind, extra)
            except Exception as e:  # the template's own errors (jinja, raise_exception in the template)
                raise DataError("%s: %s: %s" % (where, type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
            if len(ids) < 2:
                raise DataError("%s: %d token(s), nothing to predict" % (where, len(ids)))
            bad = [t for t in ids if not isinstance(t, int) or t < 0]
            if bad:
                raise DataError("%s: the tokenizer produced %r, not a token id" % (where, bad[0]))
            top = max(top, max(ids))
            if offset is not None and mask_prompt is not False:
                mismatched += not matches
                untrained += offset >= len(ids)
            out.append(record_line(ids, offset, mask_prompt))
    if not out:
        raise DataError("%s: no records" % path)
    if mismatched:
        notes.append("%s: %d record(s) whose prompt tokens are not a prefix of the chat's; masked by the prompt's "
                     "length, as mlx-lm does" % (path, mismatched))
    if untrained:
        notes.append("%s: %d record(s) with no target under --mask-prompt (the last message renders to nothing "
                     "after the prompt)" % (path, untrained))
    return out, kind, top


def write_atomic(path, lines):
    """Write to a temporary file beside path, then rename it over path: a reader never sees half a
    file, and a symlink at path is replaced, not written through."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def inputs(data, out):
    """[(input path, output path)] for a data folder or one file; out is a folder, or for one file
    also a .jsonl file (when it is not an existing folder)."""
    if os.path.isdir(data):
        found = [(os.path.join(data, s + ".jsonl"), os.path.join(out, s + ".jsonl")) for s in SPLITS]
        found = [(p, o) for p, o in found if os.path.exists(p)]
        if not found:
            raise DataError("%s: no train.jsonl, valid.jsonl or test.jsonl" % data)
        return found
    if not os.path.exists(data):
        raise DataError("%s: no such file or folder" % data)
    if out.endswith(".jsonl") and not os.path.isdir(out):
        return [(data, out)]
    return [(data, os.path.join(out, os.path.basename(data)))]


def main(argv=None):
    ap = argparse.ArgumentParser(description="mlx-lm JSONL (text, prompt/completion, chat) to winattn train's "
                                             "token records, with the checkpoint's tokenizer and chat template.")
    ap.add_argument("--model", required=True, help="checkpoint folder with the tokenizer (tokenizer.json, "
                                                   "tokenizer_config.json with the chat template)")
    ap.add_argument("--data", required=True, help="folder with train/valid/test.jsonl, or one .jsonl file")
    ap.add_argument("--out", required=True, help="folder for the converted files (same names); for one input "
                                                 "file also a .jsonl file")
    ap.add_argument("--mask-prompt", action=argparse.BooleanOptionalAction, default=None,
                    help="by default records carry the prompt's length (\"offset\") and `winattn train "
                         "--mask-prompt` decides; --mask-prompt writes the mask itself (the completion / last "
                         "message only); --no-mask-prompt writes no offset (every token trained)")
    args = ap.parse_args(argv)
    try:
        if not os.path.isdir(args.model):
            raise DataError("%s: not a checkpoint folder" % args.model)
        files = inputs(args.data, args.out)
        for src, dst in files:
            if os.path.exists(dst) and os.path.samefile(src, dst):
                raise DataError("%s: --out would replace the input" % dst)
        try:
            tokenizer = load_tokenizer(args.model)
        except DataError:
            raise
        except Exception as e:
            raise DataError("%s: cannot load the tokenizer (%s: %s)" % (args.model, type(e).__name__,
                                                                        str(e).splitlines()[0] if str(e) else ""))
        notes, converted = [], []
        for src, dst in files:  # all of them first: a bad record anywhere leaves --out as it was
            lines, kind, top = convert(tokenizer, src, args.mask_prompt, notes)
            converted.append((dst, lines, kind, top))
        for dst, _, _, _ in converted:
            os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
        for dst, lines, kind, top in converted:
            write_atomic(dst, lines)
            # the model's vocab_size must exceed the largest id (winattn train checks it)
            how = {None: "; prompt lengths as \"offset\" (winattn train --mask-prompt trains on the rest only)",
                   True: "; prompts masked", False: ""}[args.mask_prompt] if kind != "text" else ""
            print("%s: %d %s records, largest token id %d%s" % (dst, len(lines), kind, top, how))
        for n in notes:
            print("note: " + n, file=sys.stderr)
    except DataError as e:
        print("prepare_data.py: %s" % e, file=sys.stderr)
        return 1
    except OSError as e:
        print("prepare_data.py: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
