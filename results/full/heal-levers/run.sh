#!/bin/bash
# heal levers at equal tokens on the 20% whiten model (runs/c20)
cd /work/main
F=".venv/bin/flowgeom compress heal runs/c20 --tokens 16384 --eval-every 100 --eval-tokens-heal 1024 --force"
run() { name=$1; shift; echo "== $name $(date +%T)"; /usr/bin/time -f "%e s %M KB" $F --out runs/arms/$name "$@" 2>&1 | grep -v "^compress heal:"; }
run A_text
run B_dense_norms --train-dense --norms
run C_onpolicy --train-dense --norms --on-policy 0.5
run D_teacher --train-dense --norms --teacher-samples 0.5
echo "== evaluate $(date +%T)"
.venv/bin/flowgeom compress evaluate builtin:smollm2 --compare runs/c20 runs/arms/A_text runs/arms/B_dense_norms runs/arms/C_onpolicy runs/arms/D_teacher --text fortunes --out runs/arms/eval.json 2>&1 | grep -v "^flowgeom:"
echo "== done $(date +%T)"
