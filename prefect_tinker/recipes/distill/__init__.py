"""The distillation toolkit: which tokens each model sees, and the targets built from the teacher.

- :mod:`.prompts`: prompt records (the conversation before the reply, an optional golden answer)
  read from any dataset format, and :class:`~.prompts.TeacherView` (what the teacher is shown
  instead: a system prompt, a template with the question and a demonstration).
- :mod:`.align`: a student's completion re-framed for the teacher -- the teacher's own rendering
  of its prompt, the completion tokens re-used, the teacher's own end-of-turn marker -- and the
  map from student target positions to teacher target positions.
- :mod:`.targets`: per-token reverse-KL advantages, top-K soft targets (``(N, K)``
  ``target_tokens`` / ``weights``) and the reverse-KL custom loss over the K slots.
- :mod:`.soft_data`: supervised sequences that keep their prompt messages (top-K soft targets).

The flow is :mod:`prefect_tinker.flows.distill`; the teacher's tasks are in
:mod:`prefect_tinker.tasks.teacher`.
"""
