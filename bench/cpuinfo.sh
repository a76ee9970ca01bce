# Sourced by the bench scripts: cpuinfo FIELD prints the first CPU's FIELD from /proc/cpuinfo
# ("model name", "vendor_id", "cpu family"), for reports that name the machine they ran on.
cpuinfo() { sed -n "s/^$1[[:space:]]*: //p" /proc/cpuinfo | head -1; }
