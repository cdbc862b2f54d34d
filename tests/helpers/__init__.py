"""What several tests share and no test is: small specs (spectext, speclib), Hugging Face models made
from configs (hfmodels), GGUF files written as llama.cpp's converter writes them (ggufwrite), the
checkpoint shards and hostile inputs of the reliability tests (shards, hostile), which import runs
in torch and which is built (torchside), and the packaged tokenizers (realtokenizers)."""
