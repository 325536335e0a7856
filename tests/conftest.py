"""Suite-wide test settings.

Under CI (``CI`` set, as ``.ci/run`` runs) hypothesis is derandomized: every CI run explores
the same examples, so a red build always reproduces.  Local runs keep random exploration,
which is where new counterexamples are found (and then pinned with ``@example``).
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
