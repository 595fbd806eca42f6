module pagedkv

go 1.19
