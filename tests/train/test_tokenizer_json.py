"""fsdpp's reader of Hugging Face tokenizer.json against the `tokenizers` package itself.

Tokenizers of the families published models use are trained here by tokenizers' own trainers on the
fortunes, then a corpus of over 10 MB (the fortunes, source code, and hostile text: invalid UTF-8, NUL,
combining marks, CJK, emoji, digit and whitespace runs, text that looks like special tokens) is
encoded by both. The ids must be identical and fsdpp's decode must equal tokenizers' decode.

  test_tokenizer_json.py PROBE [--families a,b] [--megabytes N]
PROBE is tests/train/tokenizer_probe.cpp built. Exit 1 on the first family that differs.
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

FORTUNES = Path("/usr/share/games/fortunes")
ROOT = Path(__file__).resolve().parents[2]

# The pre-tokenizer patterns of published tokenizer.json files.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")


def fortunes_text():
    parts = []
    for f in sorted(FORTUNES.iterdir()):
        if f.is_file() and f.suffix not in (".dat", ".u8"):
            parts.append(f.read_bytes())
    return parts


def source_text(limit):
    out, total = [], 0
    roots = [ROOT / "src", ROOT / "include", ROOT / "tests", Path(json.__file__).parent.parent]
    for root in roots:
        for f in sorted(root.rglob("*")):
            if f.suffix in (".cpp", ".hpp", ".py", ".md", ".txt", ".json") and f.is_file():
                b = f.read_bytes()
                out.append(b)
                total += len(b)
                if total >= limit:
                    return out
    return out


def hostile_text(rng, count):
    """Documents built to find differences: every one mixes several kinds of trouble."""
    pieces = [
        b"\xff\xfe", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80\x80", b"\x00",
        "e\u0301\u0302 a\u0308".encode(), "\u6f22\u5b57\u304b\u306a\u30ab\u30ca\ud55c\uad6d\uc5b4".encode(),
        "\U0001F600\U0001F469\u200d\U0001F4BB\U0001F1EB\U0001F1F7 \u2764\ufe0f".encode(),
        b"0123456789" * 3, "\u0663\u0664\u0665 \u00bd \u2167 \u00b2".encode(),
        b"   ", b"\t\t", b"\n\n\n", b"\r\n", "\u00a0\u2028\u3000\u0085\u000b\u000c\u2009".encode(),
        b"<|endoftext|>", b"<|endof", b"<s>", b"</s>", b" <s> ", b"<unk>", b"<0x41>", b"<|im_start|>user\n",
        b"<|eot_id|>", b"[DAY]", b"x[DAY]y", b" [DAY] ", b"Foo", b"foo", b"FOO!", b"I'M", b"they'LL", b"don't",
        "\u0130stanbul \u03a3\u039f\u03a6\u0399\u0391 \u1e9e".encode(), "\ufb01\u2460\uff21\u3392".encode(),
        b"\xef\xbb\xbf", "\u2581\u2581 x\u2581y".encode(), b"'s'S", "\u017f".encode(), b"hello world",
        "\u0915\u094d\u0937 \u0e01\u0e33".encode(),
    ]
    docs = []
    for _ in range(count):
        n = rng.randint(1, 60)
        docs.append(b"".join(rng.choice(pieces) for _ in range(n)))
    return docs


def split_documents(blobs, rng, mean=6000):
    docs = []
    for b in blobs:
        i = 0
        while i < len(b):
            n = rng.randint(1, 2 * mean)
            docs.append(b[i:i + n])
            i += n
    return docs


def byte_level_bpe(train_text, vocab, pre, normalizer=None, specials=(), added=(), ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_text, trainer)
    tok.add_tokens(list(added))
    return tok


def with_byte_pieces(tok):
    """Adds <0x00>..<0xFF> to a trained BPE's vocabulary, as Llama 2's and Mistral's have."""
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    nxt = max(max(vocab.values()), max([t["id"] for t in j["added_tokens"]] or [0])) + 1
    for b in range(256):
        name = f"<0x{b:02X}>"
        if name not in vocab:
            vocab[name] = nxt
            nxt += 1
    return Tokenizer.from_str(json.dumps(j))


def families(train_text):
    gpt2_added = [AddedToken("[DAY]", single_word=True, lstrip=True, rstrip=True, normalized=False),
                  AddedToken(" hello", normalized=True)]
    yield "gpt2", byte_level_bpe(train_text, 3000, pre_tokenizers.ByteLevel(add_prefix_space=False),
                                 specials=["<|endoftext|>"], added=gpt2_added)
    yield "llama3", byte_level_bpe(
        train_text, 3000,
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), "isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], ignore_merges=True)
    yield "qwen2", byte_level_bpe(
        train_text, 3000,
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2), "isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        normalizer=normalizers.NFC(), specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    yield "digits_nfkc", byte_level_bpe(
        train_text, 2000,
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                 pre_tokenizers.ByteLevel(add_prefix_space=True)]),
        normalizer=normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
        specials=["<|endoftext|>"], added=[AddedToken("Foo", normalized=True), AddedToken("[DAY]", lstrip=True)])

    # Metaspace BPE with byte fallback, trained with a splitting Metaspace, then laid out as Llama 2's
    # tokenizer.json (normaliser Prepend + Replace, no pre-tokenizer) and as Mistral's (Metaspace).
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=2500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  limit_alphabet=200)
    tok.train_from_iterator(train_text, trainer)
    tok = with_byte_pieces(tok)
    llama2 = Tokenizer.from_str(tok.to_str())
    llama2.pre_tokenizer = None
    llama2.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    llama2.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)])
    yield "llama2", llama2
    mistral = Tokenizer.from_str(tok.to_str())
    mistral.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    mistral.decoder = decoders.Sequence([decoders.Metaspace(replacement="\u2581", prepend_scheme="first"),
                                         decoders.ByteFallback(), decoders.Fuse()])
    mistral.add_special_tokens(["[INST]", "[/INST]"])
    yield "mistral", mistral


def write_documents(path, docs):
    with open(path, "wb") as f:
        for d in docs:
            f.write(struct.pack("<I", len(d)))
            f.write(d)


def read_results(path):
    data = Path(path).read_bytes()
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        i += 4
        ids = list(struct.unpack_from(f"<{n}i", data, i))
        i += 4 * n
        (m,) = struct.unpack_from("<I", data, i)
        i += 4
        out.append((ids, data[i:i + m]))
        i += m
    return out


def run_probe(probe, tokenizer_path, docs_path, out_path, *extra):
    p = subprocess.run([probe, str(tokenizer_path), str(docs_path), str(out_path), *extra], capture_output=True,
                       text=True)
    if p.returncode != 0:
        sys.exit(f"FAIL: tokenizer_probe {tokenizer_path}: exit {p.returncode}: {p.stderr.strip()}")
    return json.loads(p.stdout)


def first_difference(a, b):
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return min(len(a), len(b))


def check_family(name, tok, docs, probe, work):
    path = work / f"{name}.json"
    tok.save(str(path))
    texts = [d.decode("utf-8", "replace") for d in docs]
    expected = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    docs_path, out_path = work / "docs.bin", work / f"{name}.out"
    info = run_probe(probe, path, docs_path, out_path, "--threads", "2")
    got = read_results(out_path)
    assert len(got) == len(docs), (len(got), len(docs))
    if info["vocab_size"] != tok.get_vocab_size(with_added_tokens=True):
        sys.exit(f"FAIL {name}: vocab_size {info['vocab_size']} != {tok.get_vocab_size(with_added_tokens=True)}")
    tokens = 0
    for k, ((ids, decoded), want) in enumerate(zip(got, expected)):
        tokens += len(want)
        if ids != want:
            i = first_difference(ids, want)
            sys.exit(f"FAIL {name}: document {k} ({len(docs[k])} bytes) differs at token {i}:\n"
                     f"  fsdpp      {ids[max(0, i - 3):i + 5]} {[tok.id_to_token(t) for t in ids[i:i + 5]]}\n"
                     f"  tokenizers {want[max(0, i - 3):i + 5]} {[tok.id_to_token(t) for t in want[i:i + 5]]}\n"
                     f"  text {texts[k][max(0, len(tok.decode(want[:i], skip_special_tokens=False)) - 20):][:80]!r}")
        want_text = tok.decode(want, skip_special_tokens=False)
        if decoded.decode("utf-8") != want_text:
            i = first_difference(decoded.decode("utf-8"), want_text)
            sys.exit(f"FAIL {name}: decode of document {k} differs at character {i}: "
                     f"{decoded.decode('utf-8')[i:i + 40]!r} != {want_text[i:i + 40]!r}")
    print(f"{name}: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} MB, {tokens} tokens identical; decode "
          f"identical", flush=True)


def check_bad_input(probe, work):
    """A malformed or unsupported tokenizer.json: exit 2 naming the file and what is wrong in it."""
    docs = work / "one.bin"
    write_documents(docs, [b"hello"])
    good = json.loads((work / "gpt2.json").read_text())
    cases = {
        "truncated.json": ((work / "gpt2.json").read_text()[:5000], ["truncated.json", "not valid JSON", "line"]),
        "unigram.json": (json.dumps({**good, "model": {"type": "Unigram", "vocab": []}}), ["Unigram", "is not supported"]),
        "badsplit.json": (json.dumps({**good, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(?<x"},
                                                                 "behavior": "Isolated"}}),
                          ["pre_tokenizer.pattern", "offset"]),
        "badmerge.json": (json.dumps({**good, "model": {**good["model"], "merges": [["zz\u2603", "q"]]}}),
                          ["model.merges[0]", "is not in the vocabulary"]),
        "badnorm.json": (json.dumps({**good, "normalizer": {"type": "Precompiled", "precompiled_charsmap": ""}}),
                         ["normalizer", "Precompiled", "not supported"]),
        # An id far past the vocabulary (found by fuzz.tokenizer_json: a table of gigabytes).
        "hugeid.json": (json.dumps({**good, "model": {**good["model"], "vocab": {**good["model"]["vocab"],
                                                                                 "zz": 322222225}}}),
                        ["model.vocab[\"zz\"]", "322222225", "far past"]),
    }
    for file, (text, needles) in cases.items():
        (work / file).write_text(text)
        p = subprocess.run([probe, str(work / file), str(docs), str(work / "bad.out")], capture_output=True, text=True)
        if p.returncode != 2 or not all(n in p.stderr for n in needles):
            sys.exit(f"FAIL bad input {file}: exit {p.returncode}, stderr {p.stderr.strip()!r}; wanted {needles}")
    print(f"bad input: {len(cases)} malformed or unsupported tokenizer.json files refused by name", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("probe")
    ap.add_argument("--families", default="")
    ap.add_argument("--megabytes", type=float, default=10.5)
    args = ap.parse_args()
    rng = random.Random(0)
    fortunes = fortunes_text()
    train_text = [b.decode("utf-8", "replace") for b in fortunes]
    corpus = split_documents(fortunes, rng)
    corpus += split_documents(source_text(int(args.megabytes * 1e6) - sum(map(len, fortunes)) - 800_000), rng)
    corpus += hostile_text(rng, 4000)
    corpus += [b"", b" ", b"\n", b"\x00" * 100, b"9" * 5000, b" " * 5000 + b"x", b"\t \n" * 1000]
    rng.shuffle(corpus)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_documents(work / "docs.bin", corpus)
        wanted = set(filter(None, args.families.split(",")))
        for name, tok in families(train_text):
            if not wanted or name in wanted:
                check_family(name, tok, corpus, args.probe, work)
        if not wanted or "gpt2" in wanted:
            check_bad_input(args.probe, work)
    print("PASS")


if __name__ == "__main__":
    main()
