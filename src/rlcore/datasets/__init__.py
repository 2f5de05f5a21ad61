"""A run's samples: rows read from local files (:mod:`.files`), made into message logs with metadata
(:mod:`.samples`), and served per step with epochs and a resumable position (:mod:`.sources`)."""

from rlcore.datasets.files import DataError, read_rows
from rlcore.datasets.samples import Sample, SampleBuilder
from rlcore.datasets.sources import DataExhausted, DatasetSource, GeneratorSource, load_sources

__all__ = [
    "DataError",
    "DataExhausted",
    "DatasetSource",
    "GeneratorSource",
    "Sample",
    "SampleBuilder",
    "load_sources",
    "read_rows",
]
