"""The seed article's worked example, as data (standard library only).

The article (``shared/seed``, Chinese; after Sebastian Raschka's walkthrough) prints numbers that
were produced from the sentence ``'Life is short, eat dessert first'`` — its code shows ``'The sun
rises in the east'``, which would permute the rows. Inputs here are exact float32 values:

* ``EMBEDDING``: ``torch.manual_seed(123); torch.nn.Embedding(50_000, 3)`` applied to the token
  ids of ``SENTENCE`` (the article prints it to 4 decimals; ``tests`` check the rounding).
* ``TORCH_RAND_123``: the first 60 numbers ``torch.rand`` yields after ``torch.manual_seed(123)``;
  the article draws every weight from this stream in order (``W_query``, ``W_key``, ``W_value``,
  head by head, then the cross-attention's second input), so NumPy and JAX can load exactly the
  weights torch draws. ``torch_attn`` is tested to regenerate them from the seed itself.

``ARTICLE`` holds the numbers the article prints (4 decimals): published values that the
backends must reproduce. ``ARTICLE_INCONSISTENT`` holds printed numbers that the article's own
setup does not produce, and claims of its text that its own numbers contradict (an entry with
a ``"claim"``: the number that contradicts it is under ``"contradicted_by"``), each with the
reason; the walkthrough recomputes each contradicting number from the article's embedding and
weights in float64, and the tests check that they are indeed inconsistent.
"""

SENTENCE = "Life is short, eat dessert first"
CODE_SENTENCE = "The sun rises in the east"

#: ``{word: id}`` over the sorted words, as the article builds ``dc``.
DICTIONARY = {word: i for i, word in enumerate(sorted(SENTENCE.split()))}
TOKEN_IDS = [DICTIONARY[word] for word in SENTENCE.split()]

EMBEDDING = [
    [0.3373701870441437, -0.1777772158384323, -0.3035275936126709],
    [0.17937961220741272, 1.8951480388641357, 0.4954463839530945],
    [0.26919856667518616, -0.07702023535966873, -1.0204719305038452],
    [-0.21963761746883392, -0.3791698217391968, 0.7671070694923401],
    [-0.5880118608474731, 0.3486051857471466, 0.6603409647941589],
    [-1.1925020217895508, 0.6983519196510315, -1.409722924232483],
]

TORCH_RAND_123 = [
    0.29611194133758545, 0.516562283039093, 0.2516707181930542, 0.6885567903518677,
    0.07397246360778809, 0.866521954536438, 0.13657987117767334, 0.10247904062271118,
    0.18405646085739136, 0.7264467477798462, 0.3152539134025574, 0.6871066689491272,
    0.07563531398773193, 0.19663816690444946, 0.31641197204589844, 0.4017401337623596,
    0.1185683012008667, 0.8273953795433044, 0.3820844292640686, 0.6604938507080078,
    0.8535717725753784, 0.5931529998779297, 0.6367253661155701, 0.9826293587684631,
    0.27449530363082886, 0.65837562084198, 0.2775419354438782, 0.8573248386383057,
    0.8993282318115234, 0.03901386260986328, 0.9268229007720947, 0.7387571930885315,
    0.7178835272789001, 0.7058374285697937, 0.9156495332717896, 0.43398022651672363,
    0.07715076208114624, 0.3565255403518677, 0.14786267280578613, 0.5330533385276794,
    0.4066462516784668, 0.23180752992630005, 0.45453929901123047, 0.9737018942832947,
    0.4605622887611389, 0.5158750414848328, 0.42201972007751465, 0.5786035060882568,
    0.9455063343048096, 0.8057464361190796, 0.6774807572364807, 0.6086552739143372,
    0.6178964376449585, 0.6931666135787964, 0.4353882670402527, 0.03529560565948486,
    0.19079405069351196, 0.9267928600311279, 0.5298867225646973, 0.09496325254440308,
]


def take(start: int, rows: int, cols: int) -> list[list[float]]:
    """``rows × cols`` values of ``TORCH_RAND_123`` from ``start``, row-major (as torch.rand)."""
    flat = TORCH_RAND_123[start : start + rows * cols]
    return [flat[r * cols : (r + 1) * cols] for r in range(rows)]


def self_attention_weights(d_in: int = 3, d_out_kq: int = 2, d_out_v: int = 4) -> dict:
    """Weights of ``torch.manual_seed(123); SelfAttention(d_in, d_out_kq, d_out_v)``."""
    n_kq = d_in * d_out_kq
    return {
        "W_query": take(0, d_in, d_out_kq),
        "W_key": take(n_kq, d_in, d_out_kq),
        "W_value": take(2 * n_kq, d_in, d_out_v),
    }


def wrapper_weights(d_in: int = 3, d_out_kq: int = 2, d_out_v: int = 1, num_heads: int = 4) -> dict:
    """Weights of ``torch.manual_seed(123); MultiHeadAttentionWrapper(...)``, head by head."""
    per_head = 2 * d_in * d_out_kq + d_in * d_out_v
    weights = {}
    for h in range(num_heads):
        start = h * per_head
        weights[f"heads.{h}.W_query"] = take(start, d_in, d_out_kq)
        weights[f"heads.{h}.W_key"] = take(start + d_in * d_out_kq, d_in, d_out_kq)
        weights[f"heads.{h}.W_value"] = take(start + 2 * d_in * d_out_kq, d_in, d_out_v)
    return weights


def cross_second_input(d_in: int = 3, kv_len: int = 8) -> list[list[float]]:
    """``torch.rand(8, 3)`` drawn right after ``CrossAttention(3, 2, 4)`` under seed 123."""
    return take(2 * d_in * 2 + d_in * 4, kv_len, d_in)


#: The article prints 4 decimals.
PRINTED_DECIMALS = 4
#: A float64 value matches a printed number when they differ by at most half a unit in the 4th
#: decimal plus the article's own float32 rounding.
PRINTED_ATOL = 6e-5
#: A float32 result matches a printed number when its own rounding to 4 decimals is within one
#: unit of it (a float32 value just across a rounding boundary rounds the other way).
PRINTED_ATOL_FLOAT32 = 1.5e-4

#: Numbers the article prints, to 4 decimals.
ARTICLE = {
    "embedding": [
        [0.3374, -0.1778, -0.3035],
        [0.1794, 1.8951, 0.4954],
        [0.2692, -0.0770, -1.0205],
        [-0.2196, -0.3792, 0.7671],
        [-0.5880, 0.3486, 0.6603],
        [-1.1925, 0.6984, -1.4097],
    ],
    # SelfAttention(3, 2, 4) output under torch.manual_seed(123).
    "self_attention": [
        [-0.1564, 0.1028, -0.0763, -0.0764],
        [0.5313, 1.3607, 0.7891, 1.3110],
        # -0.2627 as printed; the article's weights give -0.26264992, which rounds to -0.2626
        [-0.3542, -0.1234, -0.2627, -0.3706],
        [0.0071, 0.3345, 0.0969, 0.1998],
        [0.1008, 0.4780, 0.2021, 0.3674],
        [-0.5296, -0.2799, -0.4107, -0.6006],
    ],
    # MultiHeadAttentionWrapper(3, 2, 1, num_heads=4).
    "multi_head_wrapper": [
        [-0.0185, 0.0170, 0.1999, -0.0860],
        [0.4003, 1.7137, 1.3981, 1.0497],
        [-0.1103, -0.1609, 0.0079, -0.2416],
        [0.0668, 0.3534, 0.2322, 0.1008],
        [0.1180, 0.6949, 0.3157, 0.2807],
        [-0.1827, -0.2060, -0.2393, -0.3167],
    ],
    # CrossAttention(3, 2, 4) with x_2 = torch.rand(8, 3).
    "cross_attention": [
        [0.4231, 0.8665, 0.6503, 1.0042],
        [0.4874, 0.9718, 0.7359, 1.1353],
        [0.4054, 0.8359, 0.6258, 0.9667],
        [0.4357, 0.8886, 0.6678, 1.0311],
        [0.4429, 0.9006, 0.6775, 1.0460],
        [0.3860, 0.8021, 0.5985, 0.9250],
    ],
    # Unnormalised attention scores ω = queries @ keys.T (causal section).
    "attn_scores": [
        [0.0613, -0.3491, 0.1443, -0.0437, -0.1303, 0.1076],
        [-0.6004, 3.4707, -1.5023, 0.4991, 1.2903, -1.3374],
        [0.2432, -1.3934, 0.5869, -0.1851, -0.5191, 0.4730],
        [-0.0794, 0.4487, -0.1807, 0.0518, 0.1677, -0.1197],
        [-0.1510, 0.8626, -0.3597, 0.1112, 0.3216, -0.2787],
        [0.4344, -2.5037, 1.0740, -0.3509, -0.9315, 0.9265],
    ],
    # softmax(ω / sqrt(2)) without a mask.
    "attn_weights": [
        [0.1772, 0.1326, 0.1879, 0.1645, 0.1547, 0.1831],
        [0.0386, 0.6870, 0.0204, 0.0840, 0.1470, 0.0229],
        [0.1965, 0.0618, 0.2506, 0.1452, 0.1146, 0.2312],
        [0.1505, 0.2187, 0.1401, 0.1651, 0.1793, 0.1463],
        [0.1347, 0.2758, 0.1162, 0.1621, 0.1881, 0.1231],
        [0.1973, 0.0247, 0.3102, 0.1132, 0.0751, 0.2794],
    ],
    # Causal weights: both methods (zero-and-renormalise, and -inf before softmax) print this.
    "causal_weights": [
        [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.0532, 0.9468, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.3862, 0.1214, 0.4924, 0.0000, 0.0000, 0.0000],
        [0.2232, 0.3242, 0.2078, 0.2449, 0.0000, 0.0000],
        [0.1536, 0.3145, 0.1325, 0.1849, 0.2145, 0.0000],
        [0.1973, 0.0247, 0.3102, 0.1132, 0.0751, 0.2794],
    ],
}

#: Printed numbers the article's own setup does not produce.
ARTICLE_INCONSISTENT = {
    "omega_3": {
        "printed": [0.8721, -0.5302, 2.1436, -1.7589, 0.9103, 1.3245],
        "why": "ω for query 3 must equal row 3 of the article's own attn_scores matrix "
        "([0.2432, -1.3934, 0.5869, -0.1851, -0.5191, 0.4730]); the printed vector comes from "
        "some other weights.",
    },
    "attention_weights_3": {
        "printed": [0.1834, 0.0452, 0.6561, 0.0133, 0.1906, 0.2885],
        "why": "softmax weights must sum to 1; these sum to 1.3771, and they are not the softmax "
        "of the printed ω_3 / sqrt(2) either ([0.1565, 0.0581, 0.3847, 0.0244, 0.1608, 0.2155]). "
        "The article's own setup gives row 3 of its attn_weights matrix.",
    },
    "context_vector_3": {
        "printed": [0.6237, 0.9845, 1.0523, 1.2654],
        "why": "the context vector of query 3 is row 3 of the article's own SelfAttention "
        "output ([-0.3542, -0.1234, -0.2627, -0.3706]), which uses the same seed and weights.",
    },
    "second_row_claim": {
        "printed": [0.5313, 1.3607, 0.7891, 1.3110],
        "why": "the article says this second row of the SelfAttention output matches the context "
        "vector it computed earlier; it computed query 3's (index 2) earlier, and printed "
        "another vector. The row is right; the claim of a match is not.",
    },
    # Claims of the text. "contradicted_by": the numbers of the article's own setup (float64,
    # scores to 4 decimals; inputs and queries counted from 1, as the article counts them).
    "lowest_score_3": {
        "claim": "Lowest compatibility: -1.7589 with input 4",
        "printed": [-1.7589, 4],
        "contradicted_by": {"lowest input": 2, "lowest score": -1.3934},
        "why": "the claim is read off the inconsistent ω₃ above; row 3 of the article's own ω "
        "has its lowest score with input 2 ('is'); its highest is query 3 itself.",
    },
    "attends_most_to_itself": {
        "claim": "a query attends most to itself, as is common in self-attention",
        "printed": [],
        "contradicted_by": {"queries attending most to themselves": 2, "queries": 6},
        "why": "nothing makes q_i · k_i the largest score: a token's query and key come from "
        "different matrices (W_query ≠ W_key); here the key of 'is' is by far the longest, so "
        "most queries attend most to 'is' or 'short,'.",
    },
    "masking_skips_positions": {
        "claim": "masking with −inf is more efficient: it avoids unnecessary computation on "
        "the masked positions",
        "printed": [],
        "contradicted_by": {"masked positions": 15, "their scores computed anyway": 15,
                            "entries the softmax exponentiates": 36},
        "why": "the article's code computes all 36 scores, overwrites the 15 above the "
        "diagonal with masked_fill and exponentiates all 36 in the softmax; it saves the first "
        "method's second normalisation, not any work at a masked position. Skipping them takes "
        "a blocked kernel that never computes a fully masked tile (blockwise_attention).",
    },
}
