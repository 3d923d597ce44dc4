#!/usr/bin/env bash
# The GPU checks in one run, by stage: the CUDA tests, the training bench with and without
# CUDA graphs (each configuration both ways, back to back, on the same GPU), the same at the
# large sizes, and the RNNs' precisions on CUDA. Every figure goes to files under $OUT
# (default runs/gpu): nvidia-smi.txt, log.txt, tests.log, bench-{eager,graphs,unroll}.json,
# large-{eager,graphs,unroll}.json, bench.md (the tables of every bench run), rnn.txt,
# profile-{eager,graphs}.json (scripts/profile_step.py, Bahdanau at the bench sizes), and
# with the decode stage decode.json (greedy and beam 5 at batch 1 and 64, and the whole
# nmt translate --beam 5, on CUDA; beam search's captured device loop against the same loop
# without graphs and the plain loop, and two workers on two CUDA streams against one; a
# second pass replays the steps kept from the first), with the prefetch stage prefetch.txt (nmt train's target
# tokens/s on the demo config with training.prefetch off and on, in turn), with the reads
# stage reads-{false,true}.json (the bench with training.deferred_reads off, then on), with
# the recipe stage recipe.txt (configs/bible_gpu.yaml trained from scratch, its wall clock,
# and beam 5's test and books BLEU with their signatures), with the batches stage
# batch-<tokens>.json (the bench's training at 4,000 to 32,000-token batches), with the
# ablate stage ablate.{txt,json} (scripts/ablate_training.py: the fused loss and the sinks,
# each off alone, CUDA graphs on).
#
#   OUT=runs/gpu bash scripts/gpu_check.sh [STAGE ...]   # stages: tests bench large profile rnn
#                                                        # decode prefetch reads batches ablate recipe (default: the
#                                                        # first five)
#   CONFIGS=bahdanau bash scripts/gpu_check.sh bench      # scripts/bench.py --configs
#   BENCH_SECONDS=120 LARGE_SECONDS=140 TEST_SECONDS=150 DECODE_SECONDS=180 ...  # stage limits
#   DECODE_MODEL=runs/demo-model.pt bash scripts/gpu_check.sh decode
#   BASE=runs/base bash scripts/gpu_check.sh bench   # also the tree in runs/base, with graphs
#   MODES="graphs base" bash scripts/gpu_check.sh bench   # which runs of the bench and large
#
# The bench and large stages run the bench once per mode of MODES (default: eager graphs
# unroll, and base with BASE), back to back on the same data and GPU: eager
# (training.cuda_graphs false), graphs (the default: the whole training loss captured),
# unroll (training.cuda_graphs_scope unroll: the decoder's unroll alone) and base, BASE's
# tree with its graphs: an earlier tree's nmt and scripts (git archive REV nmt scripts
# pyproject.toml | tar -x -C runs/base), the before of a change. Each writes
# NAME-MODE.json (bench-graphs.json, large-unroll.json, ...).
#
# decode needs a trained model (default runs/demo). A model-only checkpoint, small enough to
# travel to a GPU machine: nmt average runs/demo/best.pt runs/demo/best.pt -o runs/demo-model.pt
# (the mean of one checkpoint with itself is that checkpoint's weights, without its optimiser).
#
# Each stage has a time limit, so that the run fits one call of ten minutes. Needs a CUDA
# GPU and the project's dependencies (a machine without pydantic or datasets can take their
# wheels from .whl/: they are installed into /tmp/site first).
set -u
OUT=${OUT:-runs/gpu}
CONFIGS=${CONFIGS:-bahdanau,luong-feed,luong-nofeed}
LARGE_CONFIGS=${LARGE_CONFIGS:-bahdanau,luong-feed}
PY=${PYTHON:-python3}
STAGES=${*:-tests bench large profile rnn}
MODES=${MODES:-eager graphs unroll${BASE:+ base}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: BASE's bench runs from its own tree
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'cudnn', torch.backends.cudnn.version())"

bench_pair() {  # NAME SECONDS ARGS...: the bench in each of $MODES, back to back
    local name=$1 seconds=$2
    shift 2
    local common=(--device cuda --parts matmul,train --warmup 2 --windows 3 --steps 6
                  --work-dir "$PWD/runs/bench" --data "$PWD/data/bible" "$@")
    for mode in $MODES; do
        case $mode in
        eager) timeout "$seconds" $PY scripts/bench.py "${common[@]}" \
                   --override training.cuda_graphs=false --json "$OUT/$name-eager.json" ;;
        graphs) timeout "$seconds" $PY scripts/bench.py "${common[@]}" \
                   --json "$OUT/$name-graphs.json" ;;
        unroll) timeout "$seconds" $PY scripts/bench.py "${common[@]}" \
                   --override training.cuda_graphs_scope=unroll --json "$OUT/$name-unroll.json" ;;
        base) [ -n "${BASE:-}" ] && (cd "$BASE" && timeout "$seconds" $PY scripts/bench.py \
                   "${common[@]}" --json "$OUT/$name-base.json") ;;
        esac 2>&1 | tail -12
    done
    for mode in $MODES; do
        [ -f "$OUT/$name-$mode.json" ] || continue
        echo "### $name, $mode"
        $PY scripts/bench.py --report "$OUT/$name-$mode.json" --markdown 2>/dev/null
    done >> "$OUT/bench.md"
}

bench_override() {  # NAME SECONDS PARTS OVERRIDE: the bench with graphs and one override
    local name=$1 seconds=$2 parts=$3 override=$4
    timeout "$seconds" $PY scripts/bench.py --device cuda --parts "$parts" --warmup 2 \
        --windows 3 --steps 6 --work-dir runs/bench --configs "$CONFIGS" \
        --override "$override" --json "$OUT/$name.json" 2>&1 | tail -6
    [ -f "$OUT/$name.json" ] || return 0
    echo "### $override"
    $PY scripts/bench.py --report "$OUT/$name.json" --markdown 2>/dev/null
}

for stage in $STAGES; do
    echo "== $stage"
    case $stage in
    tests)
        timeout "${TEST_SECONDS:-210}" $PY -m pytest -p no:cacheprovider -o addopts="" \
            -m "gpu and not slow" -q --timeout 200 tests/fast/test_graphs_cuda.py \
            tests/training/test_gpu.py tests/training/test_deferred_reads.py \
            tests/decoding/test_device_loop.py tests/fast/test_packing.py \
            tests/fast/test_cells.py 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    bench)
        bench_pair bench "${BENCH_SECONDS:-170}" --configs "$CONFIGS" ;;
    large)
        bench_pair large "${LARGE_SECONDS:-150}" --configs "$LARGE_CONFIGS" --large ;;
    reads)
        # each update read at once, then once the next is queued (the default), with graphs
        for setting in false true; do
            bench_override "reads-$setting" 150 train "training.deferred_reads=$setting"
        done >> "$OUT/bench.md" ;;
    profile)
        for mode in eager graphs; do
            flag=(); [ $mode = eager ] && flag=(--override training.cuda_graphs=false)
            timeout 90 $PY scripts/profile_step.py --device cuda --config bahdanau "${flag[@]}" \
                --json "$OUT/profile-$mode.json" 2>&1 | tail -30
        done ;;
    rnn)
        timeout 45 $PY - <<'PY' 2>&1 | tee "$OUT/rnn.txt"
import torch
from torch import nn

# cuDNN GRU forward and backward at the bench's encoder size: fp32, TF32, bf16 weights
torch.manual_seed(0)
B, T, I, H = 64, 60, 256, 512
flops = 3 * 2 * 2 * 3 * H * (I + H) * B * T  # two directions, forward + 2 backward products
for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                          ("bf16", torch.bfloat16, False)):
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    rnn = nn.GRU(I, H, batch_first=True, bidirectional=True).cuda().to(dtype)
    rnn.flatten_parameters()  # one packed weight buffer, as a module moved once has
    x = torch.randn(B, T, I, device="cuda", dtype=dtype, requires_grad=True)
    ref = nn.GRU(I, H, batch_first=True, bidirectional=True).cuda().double()
    ref.load_state_dict({k: v.double() for k, v in rnn.state_dict().items()})
    out = rnn(x)[0]
    want = ref(x.detach().double())[0]
    error = ((out.double() - want).norm() / want.norm()).item()
    for _ in range(3):
        rnn(x)[0].sum().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        rnn(x)[0].sum().backward()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 20
    print(f"{name}: {ms:.2f} ms forward+backward, {flops / ms / 1e9:.1f} TFLOP/s, "
          f"relative error of the forward {error:.1e}")
PY
        ;;
    decode)
        timeout "${DECODE_SECONDS:-240}" $PY scripts/bench.py --device cuda \
            --parts matmul,decode,translate --model "${DECODE_MODEL:-runs/demo}" \
            --backends torch,torch-plain-loop,torch-loop-no-graphs,torch-2workers \
            --work-dir runs/bench --json "$OUT/decode.json" 2>&1 | tail -30
        if [ -f "$OUT/decode.json" ]; then
            echo "### decode"
            $PY scripts/bench.py --report "$OUT/decode.json" --markdown 2>/dev/null
        fi >> "$OUT/bench.md" ;;
    prefetch)
        # the demo config trained in four segments of PREFETCH_STEPS updates, resumed in turn
        # with training.prefetch false, true, false, true (one run directory: prepared once)
        run=${PREFETCH_RUN:-runs/gpu-prefetch}
        rm -rf "$run"
        steps=${PREFETCH_STEPS:-300}
        ends=()
        for setting in false true false true; do
            ends+=($(( (${#ends[@]} + 1) * steps )))
            resume=(); [ ${#ends[@]} -gt 1 ] && resume=(--resume)
            timeout 150 $PY -m nmt train configs/demo.yaml --run-dir "$run" "${resume[@]}" \
                --quiet -O training.max_steps="${ends[-1]}" -O training.prefetch=$setting \
                -O training.validate_every=100000 -O training.log_every=25 \
                -O run.device="${PREFETCH_DEVICE:-cuda}" 2>&1 | tail -3
        done
        $PY - "$run/metrics.jsonl" "$(IFS=,; echo "${ends[*]}")" <<'PY' 2>&1 | tee "$OUT/prefetch.txt"
import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if '"train"' in line]
start = 0
for end, setting in zip(map(int, sys.argv[2].split(",")), ("false", "true", "false", "true")):
    speeds = [r["target_tokens_per_s"] for r in rows if start < r["step"] <= end][1:]
    if speeds:  # each segment's first window holds its start-up (graph captures)
        print(f"updates {start + 1}-{end}, training.prefetch={setting}: median "
              f"{statistics.median(speeds):,.0f} target tokens/s over {len(speeds)} windows")
    start = end
PY
        ;;
    batches)
        # the bench's training at larger batches (GPU-sized work), graphs on: target tokens/s
        # by batch_tokens, for documenting a GPU's value (the learning rate follows
        # training.lr_reference_tokens' square-root rule in nmt train, not in the bench)
        for tokens in ${BATCH_SIZES:-4000 8000 16000 32000}; do
            bench_override "batch-$tokens" "${BATCH_SECONDS:-90}" matmul,train \
                "training.batch_tokens=$tokens"
        done >> "$OUT/bench.md" ;;
    ablate)
        # what the GPU's training paths earn (scripts/ablate_training.py): each turned off
        # alone, CUDA graphs on, alternated with everything on
        timeout "${ABLATE_SECONDS:-240}" $PY scripts/ablate_training.py --device cuda \
            --precision auto --configs "$CONFIGS" --rounds 2 \
            --paths fused_loss,gradient_sinks,weight_sink \
            --work-dir "$PWD/runs/bench" --data "$PWD/data/bible" --json "$OUT/ablate.json" \
            2>&1 | tee "$OUT/ablate.txt" | tail -20 ;;
    recipe)
        # configs/bible_gpu.yaml from scratch (data preparation included), timed, then beam 5
        # on the test and books splits with sacrebleu's signatures; RECIPE_OVERRIDES: -O ...
        run=runs/bible_gpu
        rm -rf "$run"
        SECONDS=0
        timeout "${RECIPE_SECONDS:-560}" $PY -m nmt train configs/bible_gpu.yaml --quiet \
            ${RECIPE_OVERRIDES:-} 2>&1 | tail -5
        took=$SECONDS
        {
            echo "nmt train configs/bible_gpu.yaml ${RECIPE_OVERRIDES:-}: $took s wall clock"
            tail -3 "$run/train.log" 2>/dev/null
            grep '"split": "dev"' "$run/metrics.jsonl" 2>/dev/null | tail -3
            for split in test books; do
                echo "### beam 5, $split"
                timeout 60 $PY -m nmt eval --model "$run" --split $split --beam 5 2>&1 | tail -12
            done
        } 2>&1 | tee "$OUT/recipe.txt" ;;
    *) echo "unknown stage $stage (tests bench large profile rnn decode prefetch reads batches ablate recipe)" ;;
    esac
done
echo "== done"
