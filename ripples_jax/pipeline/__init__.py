"""DSP and its baselines: model-parallel pipelines with layer-wise staleness (DESIGN 4).

  split.py      a model as K depth-wise stages
  tick.py       the tick (bp, dsp, ddg, fr through link delays), the staleness ring buffers
  baselines.py  whole-model steps (bp, gpipe, dni), evaluation, METHODS: every method's (init, step)
  timing.py     iteration-time model of every method, stragglers
  train.py      the training loop behind experiments/train_dsp.py, writing through RunLog
"""
