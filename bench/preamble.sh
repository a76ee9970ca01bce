# Sourced by the bench scripts that run `fsdpp`, once `build` names the build folder: the venv's
# python, that build's fsdpp CLI, the CPU's name for the report, and a scratch folder `work`
# removed on exit.
python=${FSDPP_VENV:-$HOME/.cache/fsdpp/venv}/bin/python
fsdpp=$(realpath "$build/fsdpp")
source bench/cpuinfo.sh
cpu=$(cpuinfo 'model name')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
