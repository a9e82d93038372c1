#!/usr/bin/env bash
# Where a command's CPU time goes, by thread: runs the command, reads every thread's counters
# (/proc/PID/task/*/stat, schedstat and status) every 0.2 s while it runs, and writes per thread
# name (the number of a pool's thread dropped: `compare-3` counts as `compare`; the process's
# first thread as `main`) the threads seen and, at their last reading: CPU seconds (user +
# system), of them in the kernel (system), seconds spent runnable but waiting for a core (the
# scheduler's run delay: the cores taken by other threads), involuntary context switches (taken
# off a core while it could run), and minor and major page faults. A thread that starts and ends
# between two readings is missed, and one that ends counts up to its last reading: the figures
# are a lower bound, close for the long-lived pools. The readings use no process of their own.
#
#   scripts/thread-cpu.sh OUT.txt COMMAND [ARGS...]    (exits with the command's status)
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: scripts/thread-cpu.sh OUT.txt COMMAND [ARGS...]" >&2; exit 2; }
out=$1
shift
"$@" &
pid=$!
declare -A cpu sys wait invol minflt majflt name
tck=$(getconf CLK_TCK)
while kill -0 "$pid" 2>/dev/null; do
    for d in /proc/"$pid"/task/*; do
        read -r s < "$d/stat" 2>/dev/null || continue
        tid=${s%% *}
        c=${s#*(}
        c=${c%%)*}
        [ "$tid" = "$pid" ] && c=main
        # Fields after the name's closing parenthesis: state is 0 here, minflt 7, majflt 9,
        # utime 11, stime 12 (stat's fields 3, 10, 12, 14 and 15).
        read -r -a f <<< "${s##*) }"
        cpu[$tid]=$((f[11] + f[12]))
        sys[$tid]=${f[12]}
        minflt[$tid]=${f[7]}
        majflt[$tid]=${f[9]}
        # schedstat: nanoseconds on a core, nanoseconds runnable waiting for one, timeslices.
        if read -r _ w _ < "$d/schedstat" 2>/dev/null; then wait[$tid]=$w; fi
        while read -r k v; do
            [ "$k" = nonvoluntary_ctxt_switches: ] && invol[$tid]=$v
        done < "$d/status" 2>/dev/null
        name[$tid]=$c
    done
    sleep 0.2
done
wait "$pid"
rc=$?
{
    echo "exit $rc; by thread name: CPU s (user + system), system s, waiting for a core s, involuntary switches, minor and major faults (CLK_TCK $tck)"
    for t in "${!cpu[@]}"; do
        echo "${name[$t]} ${cpu[$t]} ${sys[$t]} ${wait[$t]:-0} ${invol[$t]:-0} ${minflt[$t]} ${majflt[$t]}"
    done |
        awk -v tck="$tck" '{g = $1; sub(/-[0-9]+$/, "", g); s[g] += $2; y[g] += $3; w[g] += $4; v[g] += $5; f[g] += $6; F[g] += $7; n[g]++}
            END {for (g in s) printf "%-24s threads %4d  cpu %9.2f s  sys %7.2f s  wait %7.2f s  invol %8d  minflt %9d  majflt %6d\n",
                g, n[g], s[g] / tck, y[g] / tck, w[g] / 1e9, v[g], f[g], F[g]}' |
        sort -k5 -nr
} > "$out"
exit $rc
