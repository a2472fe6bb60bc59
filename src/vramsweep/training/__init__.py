"""What a trial runs around :func:`vramsweep.loop.fit`: the trial's callbacks (:mod:`.callbacks`: progress,
W&B rows, train loss, tracked peak, periodic evaluation, fault injection, gradient bytes) and the figures it
records from them after training (:mod:`.figures`: initial and final evaluation, throughput, memory).
The recipe that puts them together is :mod:`vramsweep.trial`.
"""
