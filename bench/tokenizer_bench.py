"""Encode throughput of fsdpp's tokenizer.json reader against the tokenizers package itself.

The same corpus (the fortunes and source code, about 10 MB in documents of up to 12 KB) and the same
tokenizer file on both sides: byte-level BPEs of 32,000 tokens trained here by tokenizers' own trainer
with GPT-2's and Llama 3's pre-tokenizers, and a Metaspace BPE with byte fallback laid out as Llama
2's. tokenizers runs `encode_batch(texts, add_special_tokens=False)` on RAYON_NUM_THREADS threads,
fsdpp `Tokenizer::encode` per document (one thread) or `encode_all` (two), in tokenizer_probe. Each
side is a fresh process per measurement; rounds interleave the sides. Ids are compared every time.
  tokenizer_bench.py PROBE OUT.md [--rounds 6]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "train"))
import test_tokenizer_json as t  # noqa: E402

TOKENIZERS_SIDE = r"""
import os, struct, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
data = open(sys.argv[2], "rb").read()
docs, i = [], 0
while i < len(data):
    (n,) = struct.unpack_from("<I", data, i); i += 4
    docs.append(data[i:i + n].decode("utf-8", "replace")); i += n
tok.encode_batch(docs[:50], add_special_tokens=False)  # the thread pool started
t0 = time.perf_counter()
enc = tok.encode_batch(docs, add_special_tokens=False)
seconds = time.perf_counter() - t0
with open(sys.argv[3], "wb") as f:
    for e in enc:
        f.write(struct.pack("<I", len(e.ids)) + struct.pack(f"<{len(e.ids)}i", *e.ids))
print(seconds)
"""


def read_ids(path, with_text):
    data = Path(path).read_bytes()
    out, i = [], 0
    import struct
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        i += 4
        out.append(data[i:i + 4 * n])
        i += 4 * n
        if with_text:
            (m,) = struct.unpack_from("<I", data, i)
            i += 4 + m
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("probe")
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    rng = random.Random(0)
    fortunes = t.fortunes_text()
    corpus = t.split_documents(fortunes, rng) + t.split_documents(t.source_text(8_000_000), rng)
    mb = sum(map(len, corpus)) / 1e6
    train = [b.decode("utf-8", "replace") for b in fortunes]
    work = Path(tempfile.mkdtemp())
    t.write_documents(work / "docs.bin", corpus)
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers, Regex
    toks = {
        "GPT-2 byte-level": t.byte_level_bpe(train, 32000, pre_tokenizers.ByteLevel(add_prefix_space=False),
                                             specials=["<|endoftext|>"]),
        "Llama 3 byte-level": t.byte_level_bpe(
            train, 32000, pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(t.LLAMA3), "isolated"),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
            specials=["<|begin_of_text|>", "<|end_of_text|>"], ignore_merges=True),
    }
    meta = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    meta.train_from_iterator(train, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<unk>", "<s>", "</s>"],
                                                         show_progress=False, limit_alphabet=200))
    meta = t.with_byte_pieces(meta)
    meta.pre_tokenizer = None
    meta.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    toks["Llama 2 Metaspace, byte fallback"] = meta
    rows = []
    for name, tok in toks.items():
        path = work / "tokenizer.json"
        tok.save(str(path))
        times = {(side, threads): [] for side in ("fsdpp", "tokenizers") for threads in (1, 2)}
        for r in range(args.rounds):
            for threads in (1, 2):
                order = ("fsdpp", "tokenizers") if r % 2 == 0 else ("tokenizers", "fsdpp")
                for side in order:
                    if side == "fsdpp":
                        extra = ["--threads", "2"] if threads == 2 else []
                        p = subprocess.run([args.probe, str(path), str(work / "docs.bin"), str(work / "a.out"), *extra],
                                           capture_output=True, text=True, check=True)
                        times[(side, threads)].append(json.loads(p.stdout)["seconds"])
                    else:
                        env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
                        p = subprocess.run([sys.executable, "-c", TOKENIZERS_SIDE, str(path), str(work / "docs.bin"),
                                            str(work / "b.out")], capture_output=True, text=True, env=env, check=True)
                        times[(side, threads)].append(float(p.stdout))
                if read_ids(work / "a.out", True) != read_ids(work / "b.out", False):
                    sys.exit(f"{name}: ids differ between fsdpp and tokenizers")
        for threads in (1, 2):
            f = [mb / s for s in times[("fsdpp", threads)]]
            h = [mb / s for s in times[("tokenizers", threads)]]
            ratios = [a / b for a, b in zip(f, h)]
            rows.append((name, threads, statistics.median(f), min(f), max(f), statistics.median(h), min(h), max(h),
                         statistics.median(ratios), min(ratios), max(ratios)))
            print(f"{name}, {threads} thread(s): fsdpp {statistics.median(f):.1f} MB/s, tokenizers "
                  f"{statistics.median(h):.1f} MB/s, ratio {statistics.median(ratios):.2f}", flush=True)
    with open(args.out, "w") as f:
        f.write("# Tokenizer encode throughput: fsdpp against Hugging Face tokenizers\n\n")
        f.write(f"`bash bench/run_tokenizer_bench.sh` ({args.rounds} interleaved rounds; "
                f"{time.strftime('%Y-%m-%d')}; {os.environ.get('FSDPP_CPU', 'this machine')}; "
                f"tokenizers {__import__('tokenizers').__version__}).\n\n")
        f.write(f"Corpus: the fortunes and source code, {len(corpus)} documents, {mb:.1f} MB. Each side encodes "
                "the whole corpus in a fresh process; ids identical in every round. MB/s median (min-max); the "
                "ratio is fsdpp over tokenizers per round.\n\n")
        f.write("| tokenizer (32,000 tokens) | threads | fsdpp MB/s | tokenizers MB/s | fsdpp / tokenizers |\n")
        f.write("|---|---|---|---|---|\n")
        for (name, th, fm, fl, fh, hm, hl, hh, rm, rl, rh) in rows:
            f.write(f"| {name} | {th} | {fm:.1f} ({fl:.1f}-{fh:.1f}) | {hm:.1f} ({hl:.1f}-{hh:.1f}) | "
                    f"{rm:.2f}x ({rl:.2f}-{rh:.2f}) |\n")


if __name__ == "__main__":
    main()
