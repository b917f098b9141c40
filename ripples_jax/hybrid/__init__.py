"""Ripples across DSP pipelines: R replicas of a K-stage pipeline, each stage's replicas averaging in
Partial All-Reduce groups of their own (docs/design.md 4.7).

clock.py  the clock: replica ticks at their slowest stage's pace, per-stage Group Buffers and generators
sim.py    exact numerics of the clock's events on the R replicas' stacked stage states (executor hybrid)
devices.py  R x K devices of this process, a thread per replica, the wall clock (executor hybrid/devices)
"""
