"""DSP and its baselines: model-parallel pipelines with layer-wise staleness (docs/design.md 4).

(models/split.py splits a model into K depth-wise stages; inputs.build_pipeline builds the inputs)
methods.py    every method's record: what it is (label, step, placements, link delays, ring, shape in
              the timing model), the one place a method is registered
tick.py       the tick (bp, dsp, ddg, fr through link delays), the staleness ring buffers
baselines.py  whole-model steps (bp, gpipe, dni), evaluation, METHODS: every method's (init, step)
timing.py     iteration-time model of every method, stragglers
train.py      the single-process training loop (placement=single), writing through RunLog
per_process.py  stage k in process k (placement=per_process); link.py: the point-to-point transfers
"""
