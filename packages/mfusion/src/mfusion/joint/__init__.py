"""Passes on Inductor's joint forward+backward graph (``joint_custom_pre_pass``).

They run before AOTAutograd's partitioner decides what the forward saves for backward, which
the post-grad passes in :mod:`mfusion.passes` cannot change; so they are not in the post-grad
pass registry and each has its own :class:`~mfusion.config.MFusionConfig` switch.
"""
