"""The two numerical choices of the authors' reference HypeNet code as config switches of ours:
ALiBi decays and the all-heads RNN output norm (the importer's tests follow)."""

from __future__ import annotations

import pytest
import torch

from halo_dist.models.hypenet import HypeNetConfig
from halo_dist.models.hypenet.ops_hypenet import lightning_log_decay

# ALiBi's get_slopes for 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then every other 8-head slope
# (2^-1, 2^-3, ...) for the 2 heads left
SLOPES_6 = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]



def test_alibi_decays_interleave_and_equal_ours_for_powers_of_two():
    # ALiBi's slopes for 9 heads (the SmolLM2 student): 8-head slopes 2^-1..2^-8, then 2^-0.5
    nine = [2.0 ** -h for h in range(1, 9)] + [2 ** -0.5]
    torch.testing.assert_close(lightning_log_decay(9, decay="alibi"), -torch.tensor(nine, dtype=torch.float32))
    torch.testing.assert_close(lightning_log_decay(6, decay="alibi"), -torch.tensor(SLOPES_6, dtype=torch.float32))
    for n in (4, 8, 16, 32, 64):
        assert torch.equal(lightning_log_decay(n, decay="alibi"), lightning_log_decay(n))
    assert not torch.allclose(lightning_log_decay(9, decay="alibi"), lightning_log_decay(9))
    assert (HypeNetConfig().rnn_output_norm, HypeNetConfig().lightning_decay) == ("per_head", "hype")  # ours
    for key in ("rnn_output_norm", "lightning_decay"):
        with pytest.raises(ValueError, match=f"{key}='x' is unknown"):
            HypeNetConfig(**{key: "x"})
