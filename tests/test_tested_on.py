"""The support matrix's "Tested on ComfyUI" column against this ComfyUI's tests: the record it is
generated from (tests/tested_on.json) must list, for this release, exactly the plan families whose
tests run here. A family marked tested on a release whose tests skip it fails here, on that
release (CI runs this in the smoke subset on 0.3.75 as on 0.33.0); so does one tested but not
marked. PARALLEL_RECORD_TESTED_ON=1 writes this release's entry instead (then run
tools/support_matrix.py to regenerate the README)."""
import os

import pytest

from support_matrix import load_record, save_record
from tested_on import families_run_here, release


@pytest.mark.smoke
def test_tested_on_column_lists_what_this_release_tests_run():
    here = families_run_here()
    if os.environ.get("PARALLEL_RECORD_TESTED_ON") == "1":
        save_record(release(), here)
    marked = load_record().get(release())
    assert marked is not None, f"tests/tested_on.json has no entry for ComfyUI {release()}"
    assert not set(marked) - set(here), (f"marked tested on ComfyUI {release()}, but its tests skip it here: "
                                         f"{sorted(set(marked) - set(here))}")
    assert not set(here) - set(marked), (f"tested on ComfyUI {release()} but not marked: "
                                         f"{sorted(set(here) - set(marked))} (PARALLEL_RECORD_TESTED_ON=1)")
