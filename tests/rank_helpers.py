"""What the 2-rank tests' scripts share with the process they are compared against, kept apart
from the test modules so that a rank imports zlib here, not pytest and a test module's imports
(several seconds a rank on 2 cores)."""
import zlib


def hashed_decision(text):
    """The persuadee decides by a hash of its reply text (rank-free: the texts are), so groups
    differ."""
    return (None, "ACCEPT", "REJECT", "WALK_AWAY", "PENDING")[zlib.crc32(text.encode()) % 5]
