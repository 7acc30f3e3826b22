#!/usr/bin/env bash
# lm-eval-harness against `retrograd serve`: wall-clock time of one eval with num_concurrent=1 and with
# num_concurrent=8, in the same run, against the same server.
#
# What it measures: one `retrograd serve --base-only` (the default model, [serving] parallel = 8,
# queue = 32) and `lm_eval --model local-chat-completions` over a tiny local generate_until task
# (PROMPTS short arithmetic questions, exact_match, at most 16 new tokens each). lm_eval runs three
# times, num_concurrent = 1, 8, 1 (so the order is not the only difference); each run is timed
# wall-clock as a whole process (lm_eval's own start-up, some 15-25 s on 2 loaded cores, included),
# after one untimed warm-up request. It prints the times and ratio = t(1) / t(8), t(1) the median of the
# two num_concurrent=1 runs, and beside them the request phase alone (from lm_eval's progress bar, so
# the same ratio without the start-up that dilutes it at small PROMPTS). It fails (non-zero,
# one message) if lm_eval fails or the server answered any chat request with anything but 200, or
# answered fewer requests than the three evals sent.
#
#     bash scripts/bench_lm_eval.sh                     # THREADS=2 PROMPTS=24
#     THREADS=2 PROMPTS=8 bash scripts/bench_lm_eval.sh
#
# It needs the repository's .venv (retrograd built) and installs lm-eval (pinned, with its `api`
# extra: aiohttp, requests, tenacity, tiktoken) into its own .venv-lmeval from the package index on
# first use. Nothing comes from the HuggingFace Hub: the task's data is a JSONL written here, read by
# the `json` builder of `datasets`, and chat completions need no tokenizer (tokenizer_backend=None,
# tokenized_requests=False, --apply_chat_template). Set KEEP=1 to keep the temporary directory (logs, lm_eval's samples).
set -euo pipefail

LM_EVAL_VERSION=0.4.13
THREADS=${THREADS:-2}
PROMPTS=${PROMPTS:-24}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$ROOT/.venv-lmeval
TASK=retrograd_bench_arith

fail() { echo "bench_lm_eval: FAILED: $*" >&2; exit 1; }

[[ $PROMPTS =~ ^[1-9][0-9]*$ ]] || fail "PROMPTS must be a positive integer, got '$PROMPTS'"
[[ -x $ROOT/.venv/bin/python ]] || fail "$ROOT/.venv/bin/python not found (set up the repository first)"

# --- lm-eval in its own virtual environment -------------------------------------------------------
if ! "$VENV/bin/python" -c "import lm_eval, aiohttp, tenacity, requests" 2>/dev/null \
        || [[ $("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('lm_eval'))") != "$LM_EVAL_VERSION" ]]; then
    echo "installing lm-eval[api]==$LM_EVAL_VERSION into $VENV ..."
    [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV" || fail "could not create $VENV"
    "$VENV/bin/pip" install -q "lm-eval[api]==$LM_EVAL_VERSION" || fail "pip install lm-eval[api]==$LM_EVAL_VERSION"
fi

# --- the task: PROMPTS arithmetic questions in a local JSONL --------------------------------------
DIR=$(mktemp -d "${TMPDIR:-/tmp}/bench_lm_eval.XXXXXX")
SERVER_PID=
cleanup() {
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    if [[ ${KEEP:-0} == 1 ]]; then echo "kept $DIR"; else rm -rf "$DIR"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$DIR/tasks"
for ((i = 1; i <= PROMPTS; i++)); do
    a=$(( (i * 7) % 50 + 3 )); b=$(( (i * 13) % 40 + 2 ))
    printf '{"question": "What is %d plus %d? Answer with the number only.", "answer": "%d"}\n' \
        "$a" "$b" "$((a + b))"
done > "$DIR/tasks/questions.jsonl"
cat > "$DIR/tasks/$TASK.yaml" <<EOF
task: $TASK
dataset_path: json
dataset_kwargs:
  data_files:
    test: $DIR/tasks/questions.jsonl
output_type: generate_until
test_split: test
num_fewshot: 0
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\n"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: 16
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1.0
EOF

# --- the server: one retrograd serve, the aiohttp access log on (one line per request, with status) -
cat > "$DIR/train.jsonl" <<'EOF'
{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
EOF
cat > "$DIR/serve.toml" <<EOF
[model]
ctx = 1024
threads = $THREADS
[data]
train = "train.jsonl"
[serving]
parallel = 8
queue = 32
wait_seconds = 600
EOF
PORT=$("$ROOT/.venv/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
URL=http://127.0.0.1:$PORT
# `python -m retrograd.cli serve ...`, with aiohttp's access logger switched on to count status codes
(cd "$ROOT" && RETRO_THREADS=$THREADS exec .venv/bin/python -c '
import logging, sys
h = logging.StreamHandler(sys.stderr)
h.setFormatter(logging.Formatter("access %(message)s"))
a = logging.getLogger("aiohttp.access")
a.setLevel(logging.INFO); a.addHandler(h); a.propagate = False
from retrograd.cli import main
sys.exit(main())' serve "$DIR/serve.toml" --base-only --port "$PORT") >"$DIR/server.log" 2>&1 &
SERVER_PID=$!

echo "starting retrograd serve on $URL (threads $THREADS) ..."
for ((t = 0; t < 600; t++)); do
    curl -sf "$URL/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$DIR/server.log" >&2; fail "retrograd serve exited during start-up"; }
    sleep 0.5
done
curl -sf "$URL/health" >/dev/null || fail "retrograd serve did not answer /health within 300 s"
MODELS=$(curl -sf "$URL/v1/models") || fail "GET /v1/models"
grep -q '"id": *"base"' <<<"$MODELS" || fail "the server does not list model 'base': $MODELS"
# one warm-up request (pages of the model, first allocations), not timed
curl -sf "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "base", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}' >/dev/null \
    || fail "the warm-up chat request failed"

# --- lm_eval, num_concurrent = 1, 8, 1 --------------------------------------------------------------
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_DATASETS_CACHE=$DIR/hf-datasets    # no shared cache: every run reads the JSONL the same way
run_eval() {  # $1 num_concurrent, $2 log name; prints the wall seconds
    local start end
    start=$(date +%s.%N)
    if ! "$VENV/bin/lm_eval" run --model local-chat-completions \
            --model_args "model=base,base_url=$URL/v1/chat/completions,num_concurrent=$1,max_retries=1,tokenized_requests=False,tokenizer_backend=None,timeout=600" \
            --tasks "$TASK" --include_path "$DIR/tasks" --apply_chat_template --batch_size 1 \
            --output_path "$DIR/out-$2" --log_samples >"$DIR/$2.log" 2>&1; then
        tail -30 "$DIR/$2.log" >&2
        fail "lm_eval with num_concurrent=$1 exited non-zero (log above)"
    fi
    end=$(date +%s.%N)
    grep -q "exact_match" "$DIR/$2.log" || { tail -30 "$DIR/$2.log" >&2; fail "lm_eval num_concurrent=$1 printed no exact_match result"; }
    if grep -q "API request failed" "$DIR/$2.log"; then
        grep "API request failed" "$DIR/$2.log" | head -5 >&2
        fail "lm_eval num_concurrent=$1 saw failed API requests"
    fi
    awk -v s="$start" -v e="$end" 'BEGIN { printf "%.2f", e - s }'
}
requests_seconds() {  # $1 log: seconds of lm_eval's "Requesting API" phase, from tqdm's closing line
    "$VENV/bin/python" - "$1" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8", errors="replace").read()
bars = re.findall(r"Requesting API: 100%\|[^|]*\| (\d+)/\d+ \[[^,\]]*,\s*([\d.]+)(s/it|it/s)\]", text)
if bars:
    n, rate, unit = int(bars[-1][0]), float(bars[-1][1]), bars[-1][2]
    print(f"{n * rate if unit == 's/it' else n / rate:.2f}")
else:
    print("?")
PY
}

echo "lm_eval ($PROMPTS prompts) num_concurrent=1 ..."; T1A=$(run_eval 1 c1a)
echo "lm_eval ($PROMPTS prompts) num_concurrent=8 ..."; T8=$(run_eval 8 c8)
echo "lm_eval ($PROMPTS prompts) num_concurrent=1 ..."; T1B=$(run_eval 1 c1b)

# --- the server's side: every chat request answered 200, and all of them arrived ----------------------
CODES=$(grep -oE '"POST /v1/chat/completions[^"]*" [0-9]{3}' "$DIR/server.log" | awk '{ print $NF }' || true)
N_ALL=$(grep -c . <<<"$CODES" || true)
N_OK=$(grep -cx 200 <<<"$CODES" || true)
if [[ $N_OK != "$N_ALL" ]]; then
    sort <<<"$CODES" | uniq -c >&2
    fail "the server answered $((N_ALL - N_OK)) of $N_ALL chat requests with a status other than 200 (counts above)"
fi
(( N_ALL == 3 * PROMPTS + 1 )) || fail "the server logged $N_ALL chat requests, expected $((3 * PROMPTS + 1)) (3 runs x $PROMPTS + warm-up)"
ACC=$(grep -oE '\|exact_match\|[^|]*\|[ 0-9.]+' "$DIR/c8.log" | head -1 | awk -F'|' '{ gsub(/ /, "", $NF); print $NF }')

R1A=$(requests_seconds "$DIR/c1a.log"); R8=$(requests_seconds "$DIR/c8.log"); R1B=$(requests_seconds "$DIR/c1b.log")
T1=$(awk -v a="$T1A" -v b="$T1B" 'BEGIN { printf "%.2f", (a + b) / 2 }')   # median of two = their mean
echo
echo "lm-eval $LM_EVAL_VERSION local-chat-completions vs retrograd serve (parallel 8, threads $THREADS), $PROMPTS prompts, max 16 new tokens; exact_match ${ACC:-?}"
echo "| num_concurrent | lm_eval wall seconds | of which requests (tqdm) |"
echo "|---|---|---|"
echo "| 1 (first)  | $T1A | $R1A |"
echo "| 8          | $T8 | $R8 |"
echo "| 1 (second) | $T1B | $R1B |"
echo "server: $N_OK/$N_ALL chat requests answered 200"
awk -v a="$T1" -v b="$T8" 'BEGIN { printf "ratio = t(1) / t(8) = %.2f / %.2f = %.2f  (wall clock, median of the two num_concurrent=1 runs)\n", a, b, a / b }'
if [[ "$R1A$R8$R1B" != *"?"* ]]; then
    awk -v a="$R1A" -v b="$R1B" -v c="$R8" 'BEGIN { m = (a + b) / 2; printf "requests only: %.2f / %.2f = %.2f\n", m, c, m / c }'
fi
