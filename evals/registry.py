"""The evaluations a job can run, by ``eval.name`` (``conf/eval/*.yaml``): one table, read by the
schema (each one's settings type), the row identity (each one's identity columns) and the job."""

from evals.corpus import CorpusDrift
from evals.reply import ReplyDrift

EVALUATIONS = {e.name: e for e in (ReplyDrift, CorpusDrift)}
