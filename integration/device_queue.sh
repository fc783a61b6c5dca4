#!/usr/bin/env bash
# Run a list of benchmark commands back to back in the background on a lent GPU machine, across several `run` calls
# (each call is capped at 10 minutes; a process in its own session outlives the call while the machine is held).
#
#   bash integration/device_queue.sh start QUEUE DIR   # QUEUE: one shell command per line ('#' lines skipped)
#   bash integration/device_queue.sh wait SECONDS DIR OUT  # until the queue ends or SECONDS pass; logs+results -> OUT
#
# Each command N runs with `cd` at the tree holding this script, output to DIR/NN.log, exit status and seconds to
# DIR/NN.rc; DIR/done appears when the queue ends. `wait` packs DIR's small files (logs, JSON, Markdown, text) into
# OUT/queue.tgz, so every call brings back what finished so far even if the machine is lost later.
# Start it from a copy of the tree (`cp -a . /tmp/tree && bash /tmp/tree/integration/device_queue.sh start ...`):
# each later call re-syncs the working tree and removes the ignored folders it does not carry, under a running queue.
set -u
cmd=${1:?start|wait}
case "$cmd" in
start)
    queue=$(readlink -f "${2:?queue file}"); dir=${3:?dir}; mkdir -p "$dir"; rm -f "$dir/done"
    root=$(cd "$(dirname "$0")/.." && pwd)
    setsid nohup bash -c '
        i=0
        while IFS= read -r line; do
            case "$line" in ""|"#"*) continue;; esac
            i=$((i+1)); n=$(printf %02d $i); t0=$(date +%s)
            echo "$line" > "$2/$n.cmd"; echo "$n $(date +%T) start: $line" >> "$2/status"
            (cd "$3" && bash -c "$line") > "$2/$n.log" 2>&1; rc=$?
            echo "$rc $(( $(date +%s) - t0 ))" > "$2/$n.rc"
            echo "$n $(date +%T) end rc=$rc after $(( $(date +%s) - t0 )) s" >> "$2/status"
        done < "$1"
        touch "$2/done"' queue "$queue" "$dir" "$root" > "$dir/queue.log" 2>&1 < /dev/null &
    echo "queue started: $(grep -cv '^\s*\(#\|$\)' "$queue") commands, logs in $dir"
    ;;
wait)
    secs=${2:?seconds}; dir=${3:?dir}; out=${4:?out}; end=$(( $(date +%s) + secs ))
    while [ ! -e "$dir/done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    cat "$dir/status" 2>/dev/null
    last=$(ls "$dir"/*.log 2>/dev/null | grep -v queue.log | tail -1)
    [ -n "$last" ] && { echo "--- tail of $last"; tail -c 3000 "$last"; }
    (cd "$dir" && find . -type f \( -name '*.log' -o -name '*.json' -o -name '*.md' -o -name '*.txt' -o -name '*.rc' -o -name '*.cmd' \
        -o -name status \) -size -4M -print0 | tar -czf "$out/queue.tgz" --null -T -)
    [ -e "$dir/done" ] && echo "queue done" || echo "queue still running"
    ;;
*) echo "usage: $0 start QUEUE DIR | wait SECONDS DIR OUT" >&2; exit 2 ;;
esac
