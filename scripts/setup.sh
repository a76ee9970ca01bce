#!/usr/bin/env bash
# Installs what fsdpp needs on Debian 12 (run as root). Safe to run again: it installs only what is
# missing, so a second run takes seconds.
#
#  - Debian packages: the compiler tool chain, Gloo, SentencePiece, the header-only libraries, the
#    test tools.
#  - LibTorch: PyTorch 2.15's, from the torch==2.15.0 wheel (a CUDA build that also runs on CPU-only
#    machines), in a virtual environment shared by every clone of this user: $FSDPP_VENV, by default
#    ~/.cache/fsdpp/venv. The same environment holds PyTorch itself and safetensors, which the tests
#    use as references. CMake finds LibTorch through it (cmake/fsdppDependencies.cmake).
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libgloo-dev
  libeigen3-dev nlohmann-json3-dev doctest-dev libcli11-dev
  libsentencepiece-dev            # tokenizers (data.tokenizer, fsdpp tokenizer train)
  libpcre2-dev libutf8proc-dev    # Hugging Face tokenizer.json: its regular expressions, NFC/NFKC
  iproute2 procps                 # network namespaces for the two-node test; ps for orphan checks
  fortunes                        # the default training corpus (/usr/share/games/fortunes)
  python3 python3-venv            # the virtual environment that holds PyTorch 2.15
  clang-14 libclang-rt-14-dev     # libFuzzer and the sanitizers for the fuzz tests
  clang-format                    # the tree's C++ layout (.clang-format, scripts/format.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing packages: ${missing[*]}; run this script as root or install them" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# ------------------------------------------------------------------ the virtual environment
venv=${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}
requirements=(torch==2.15.0 safetensors numpy transformers==5.25.0)
# Debian's own interpreter: its venv module is the python3-venv package installed above.
python=/usr/bin/python3
[[ -x $python ]] || python=$(command -v python3)

if [[ ! -x $venv/bin/python ]]; then
  echo "setup: creating the virtual environment $venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
fi
# The stamp names what was installed; pip runs only when the list changed or a package is gone.
stamp=$venv/.fsdpp-requirements
check='import numpy, safetensors, torch, transformers; print(f"setup: PyTorch {torch.__version__} in", torch.__path__[0])'
if [[ "$(cat "$stamp" 2>/dev/null)" != "${requirements[*]}" ]] || ! "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "setup: installing ${requirements[*]} into $venv (about 3 GB the first time)"
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q "${requirements[@]}"
  echo "${requirements[*]}" >"$stamp"
  "$venv/bin/python" -c "$check"
fi
