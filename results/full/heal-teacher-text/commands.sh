set -x
# runs/sweep-b0.1 comes from: flowgeom compress sweep builtin:smollm2 --out runs/sweep --budgets 0.1,0.2 --heal 102400
# run from the repository root; each step alone on a 2-vCPU VM
date
.venv/bin/python benchmarks/teacher_text.py --out runs/teacher.txt --tokens 102400
date
.venv/bin/flowgeom compress run builtin:smollm2 --out runs/c10 --method whiten --budget 0.1 --force
date
.venv/bin/flowgeom compress heal runs/c10 --out runs/c10-teacher --heal-text runs/teacher.txt --tokens 102400 --force
date
.venv/bin/flowgeom compress evaluate builtin:smollm2 --compare runs/sweep-b0.1 runs/c10-teacher --text fortunes --json --out results/full/heal-teacher-text/evaluate.json
date
echo done
