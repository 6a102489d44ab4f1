"""Pure tensor functions sharing one signature: (q_nope, q_pe, c_kv, k_pe, kv_lens, w_uk, w_uv, scale).

- q_nope [B,S,H,dn], q_pe [B,S,H,dr]: the S new queries of each row (rope already applied);
- c_kv [B,T,L], k_pe [B,T,dr]: each row's context, new tokens included, T >= max(kv_lens);
- kv_lens [B] (CPU long): row b's context length; its S queries are its last S tokens
  (positions kv_lens[b]-S .. kv_lens[b]-1) and attend causally;
- w_uk [H,dn,L], w_uv [H,dv,L]: kv_b_proj.weight viewed per head;
- key_mask [B,T] bool (keyword, optional): False hides a key from every query (left padding);
- returns out [B,S,H,dv] in the query dtype and lse [B,S,H] in fp32 (natural log of the
  softmax denominator of the scaled scores).
"""

from mlakit.ops.absorb import absorb
from mlakit.ops.materialize import materialize
from mlakit.ops.merge import merge
from mlakit.ops.reference import reference

OPS = {"absorb": absorb, "materialize": materialize}

__all__ = ["OPS", "absorb", "materialize", "merge", "reference"]
