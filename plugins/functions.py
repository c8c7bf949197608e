"""Built-in functions. Import paths, not classes: listing functions imports nothing heavy."""

from forge.hookspecs import hookimpl


@hookimpl
def forge_functions():
    return {
        "probe_gen": "forge.functions.probe_gen:ProbeGen",
        "score": "forge.functions.score:Score",
        "embed": "forge.functions.embed:Embed",
        "surprisal": "forge.functions.surprisal:Surprisal",
        "logit_lens": "forge.functions.logit_lens:LogitLens",
        "token_entropy": "forge.functions.token_entropy:TokenEntropy",
        "class_means": "forge.functions.class_means:ClassMeans",
        "generate": "forge.functions.generate:Generate",
    }
