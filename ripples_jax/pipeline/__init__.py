"""DSP and its baselines: model-parallel pipelines with layer-wise staleness (DESIGN 4).

  split.py    a model as K depth-wise stages
  dsp.py      the tick (bp, dsp, ddg, fr through link delays), GPipe, the staleness ring buffer
  timing.py   iteration-time model of every method, stragglers
"""
