"""The papers each kind of card cites, by title and link (:data:`REFERENCES`)."""

from __future__ import annotations


_ROTATION = {
    "authors": "Binchi Zhang, Zaiyi Zheng, Zhengzhang Chen, Jundong Li",
    "title": "Beyond the Permutation Symmetry of Transformers: The Role of Rotation for Model Fusion",
    "venue": "ICML 2025",
    "url": "https://github.com/zhengzaiyi/RotationSymmetry",
}
_PROCRUSTES = {
    "authors": "Ekaterina Grishina, Mikhail Gorbunov, Maxim Rakhuba",
    "title": "ProcrustesGPT: Compressing LLMs with Structured Matrices and Orthogonal Transformations",
    "url": "https://github.com/GrishKate/ProcrustesGPT",
}
_SLICEGPT = {
    "authors": "Saleh Ashkboos, Maximilian L. Croci, Marcelo Gennari do Nascimento, Torsten Hoefler, James Hensman",
    "title": "SliceGPT: Compress Large Language Models by Deleting Rows and Columns",
    "venue": "ICLR 2024",
    "url": "https://arxiv.org/abs/2401.15024",
}
#: the papers each kind of card cites, by title and link
REFERENCES = {
    "rotate": [_ROTATION],
    "match": [_ROTATION],
    "merge": [_ROTATION],
    "compress": [_PROCRUSTES, _SLICEGPT],
    "farr": [
        {
            "authors": "Chris McCormick",
            "title": "Fuse and Rank Reduce (FaRR)",
            "url": "https://github.com/chrisjmccormick/shared-subspaces",
        }
    ],
    "to_tpa": [
        {
            "authors": "Yifan Zhang, Yifeng Liu, Huizhuo Yuan, Zhen Qin, Yang Yuan, Quanquan Gu, Andrew Chi-Chih Yao",
            "title": "Tensor Product Attention Is All You Need",
            "url": "https://github.com/tensorgi/T6",
        }
    ],
    "heal": [
        {
            "authors": "Geoffrey Hinton, Oriol Vinyals, Jeff Dean",
            "title": "Distilling the Knowledge in a Neural Network",
            "url": "https://arxiv.org/abs/1503.02531",
        },
        {
            "authors": "Edward J. Hu et al.",
            "title": "LoRA: Low-Rank Adaptation of Large Language Models",
            "venue": "ICLR 2022",
            "url": "https://arxiv.org/abs/2106.09685",
        },
    ],
}
