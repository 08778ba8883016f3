"""torch's elastic `utils` path: the data helpers elastic training scripts import (data/)."""
