# Sourced by the scripts that compare two builds (bench/run_build_ab.sh, bench/run_attention_ab.sh).
# ab_builds USAGE DEFAULT_ROUNDS NAME [rounds] label=dir label=dir [more ...] sets name, rounds,
# labels and dirs (each dir holding a build's libfsdpp.so and libfsdpp_gloo.so, made absolute), and
# extra: the arguments after the two dirs, for the caller to check. Prints USAGE and exits on a
# malformed command line.
ab_builds() {
  local usage=$1 v dir
  rounds=$2
  shift 2
  [[ $# -ge 3 && $1 =~ ^[a-z0-9_]+$ ]] || { echo "$usage"; exit 1; }
  name=$1
  shift
  if [[ $1 =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
  [[ $# -ge 2 && $rounds -gt 0 ]] || { echo "$usage"; exit 1; }
  labels=() dirs=()
  for v in "$1" "$2"; do
    dir=${v#*=}
    [[ $v == *=* && -f $dir/libfsdpp.so && -f $dir/libfsdpp_gloo.so ]] ||
      { echo "$v: expected label=dir, dir holding libfsdpp.so and libfsdpp_gloo.so"; exit 1; }
    labels+=("${v%%=*}") dirs+=("$(realpath "$dir")")
  done
  shift 2
  extra=("$@")
}
