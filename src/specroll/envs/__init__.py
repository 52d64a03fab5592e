"""Environments for multi-turn, tool-using episodes: the interface an environment implements
(:mod:`specroll.envs.base`), the built-in calculator task (:mod:`specroll.envs.calculator`) and
``verifiers`` tasksets (:mod:`specroll.envs.verifiers_env`, the ``verifiers`` extra)."""
