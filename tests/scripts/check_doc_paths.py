#!/usr/bin/env python3
"""Every relative link and every file path that the README and docs name exists in the tree.

    check_doc_paths.py REPO_ROOT

Checked: markdown links to relative targets (anchors dropped), and backquoted paths under the
tree's top-level folders (`include/fsdpp/comm/comm.hpp`, `bench/results/memory.md`) or source file
names without a folder (`send_waits.hpp`, which must be some file's name). Paths with placeholders
(<N>, *, {name}, ..., $VAR) and run outputs (runs/, build/) are not files of the tree and are left
out. Exits 1 listing each broken one with its document and line.
"""
import os
import re
import subprocess
import sys

root = os.path.abspath(sys.argv[1])
tracked = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True, check=True).stdout.split()
names = {os.path.basename(p) for p in tracked}
top = ("include/", "src/", "tests/", "scripts/", "bench/", "recipes/", "configs/", "docs/", "examples/", "cmake/", ".ci/")
docs = ["README.md", "bench/README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
link = re.compile(r"\]\(([^)\s]+)\)")
code = re.compile(r"`([^`\s]+)`")
placeholder = re.compile(r"[<>*{}$]|\.\.\.|PREFIX|NAME")

broken = []
for doc in docs:
    here = os.path.dirname(os.path.join(root, doc))
    with open(os.path.join(root, doc), encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            for target in link.findall(line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                path = target.split("#")[0]
                if path and not os.path.exists(os.path.join(here, path)):
                    broken.append(f"{doc}:{n}: link {target}")
            for text in code.findall(line):
                text = text.rstrip(".,;:)")
                if placeholder.search(text) or text.startswith(("runs/", "build/", "/")):
                    continue
                path = text.split(":")[0]
                if path.startswith(top):
                    if not os.path.exists(os.path.join(root, path)):
                        broken.append(f"{doc}:{n}: path {text}")
                elif "/" not in path and re.fullmatch(r"[\w.-]+\.(hpp|cpp|sh|py)", path) and path not in names:
                    broken.append(f"{doc}:{n}: file {text}")
if broken:
    print(f"{len(broken)} path(s) the docs name do not exist:")
    print("\n".join("  " + b for b in broken))
    sys.exit(1)
print(f"docs: every link and path in {len(docs)} documents exists")
