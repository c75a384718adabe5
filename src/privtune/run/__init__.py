"""The run pipeline shared by every budget-spending command (``train``, ``tune`` and the black-box audit's
training run): :mod:`privtune.run.pipeline` (the stage order, ``execute(job)``), :mod:`privtune.run.inputs`
(the one split loader), :mod:`privtune.run.budget` (the one reservation path) and :mod:`privtune.run.release`
(the files of RUN_DIR and the commit)."""
