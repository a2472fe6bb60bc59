"""The environment variable the sweeper sets for its trial processes: how many trials run at once
(``hydra.sweeper.n_jobs``); ``train.threads=auto`` (:mod:`vramsweep.measure.threads`) takes a share of the
cores per trial. Its own module so the sweeper, which never imports torch, can name it."""

CONCURRENT_ENV = "VRAMSWEEP_CONCURRENT_TRIALS"
