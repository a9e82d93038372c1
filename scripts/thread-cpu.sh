#!/usr/bin/env bash
# Where a command's CPU time goes, by thread: runs the command, reads every thread's CPU time
# (user + system, /proc/PID/task/*/stat) every 0.2 s while it runs, and writes per thread name
# (the number of a pool's thread dropped: `compare-3` counts as `compare`; the process's first
# thread as `main`) the threads seen and the CPU seconds they had at their last reading. A thread
# that starts and ends between two readings is missed, and one that ends counts up to its last
# reading: the figures are a lower bound, close for the long-lived pools.
#
#   scripts/thread-cpu.sh OUT.txt COMMAND [ARGS...]    (exits with the command's status)
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: scripts/thread-cpu.sh OUT.txt COMMAND [ARGS...]" >&2; exit 2; }
out=$1
shift
"$@" &
pid=$!
declare -A cpu name
tck=$(getconf CLK_TCK)
while kill -0 "$pid" 2>/dev/null; do
    for st in /proc/"$pid"/task/*/stat; do
        s=$(cat "$st" 2>/dev/null) || continue
        tid=${s%% *}
        c=${s#*(}
        c=${c%%)*}
        [ "$tid" = "$pid" ] && c=main
        # Fields after the name's closing parenthesis: state is 1, utime 12, stime 13.
        read -r -a f <<< "${s##*) }"
        cpu[$tid]=$((f[11] + f[12]))
        name[$tid]=$c
    done
    sleep 0.2
done
wait "$pid"
rc=$?
{
    echo "exit $rc; CPU seconds by thread name (CLK_TCK $tck)"
    for t in "${!cpu[@]}"; do echo "${name[$t]} ${cpu[$t]}"; done |
        awk -v tck="$tck" '{g = $1; sub(/-[0-9]+$/, "", g); s[g] += $2; n[g]++}
            END {for (g in s) printf "%-24s threads %4d  cpu %9.2f s\n", g, n[g], s[g] / tck}' |
        sort -k5 -nr
} > "$out"
exit $rc
